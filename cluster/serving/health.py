"""/health in a Serve application of its own, next to raypd's (`<prefix>/health`; cluster.serving.app.deploy runs both).

An ingress replica serves every request on one event loop: a flood of requests it sheds (600 at once, on two cores)
kept its own /health waiting 1-4 s behind them. This replica takes nothing but /health, and answers from the replica
directory: each ingress replica publishes, once a second, what it would answer itself (Ingress.problem). So /health
is 503 naming each problem a live ingress replica reports, or that none has refreshed its entry within
INGRESS_STALE_S (an ingress whose loop has not turned for that long is not serving either), else 200.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve

from cluster.config import LimitsSettings
from cluster.serving.directory import Directory
from cluster.edge.openai_format import error_body

INGRESS_STALE_S = 15.0
_RETRY_AFTER_S = LimitsSettings.model_fields["retry_after_s"].default

health_api = FastAPI(title="raypd health")


class _PrefixItself:
    """ASGI middleware: `<prefix>/health` itself reaches this app as its root path with nothing after it, which
    Starlette would answer with a redirect to `.../health/`; it is served as `/` instead."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == scope.get("root_path", ""):
            scope = dict(scope, path=scope["path"] + "/")
        await self.app(scope, receive, send)


health_api.add_middleware(_PrefixItself)


def health_response(problem: str | None, retry_after_s: int) -> JSONResponse:
    if problem:
        return JSONResponse(error_body(problem, "service_unavailable"), 503,
                            headers={"Retry-After": str(retry_after_s)})
    return JSONResponse({"status": "ok"})


def verdict(directory: Directory) -> str | None:
    """The problems of the application's live ingress replicas (each named once), or None when all can serve."""
    ingresses = directory.entries("ingress", stale_s=INGRESS_STALE_S)
    if not ingresses:
        return f"no ingress replica has answered in the last {INGRESS_STALE_S:.0f} s"
    problems = dict.fromkeys(p for e in ingresses if e.problem for p in e.problem.split("; "))
    return "; ".join(problems) or None


@serve.deployment(name="health", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(health_api)
class Health:
    def __init__(self, app_name: str, retry_after_s: int = _RETRY_AFTER_S):
        self._directory = Directory(app_name)
        self._retry_after_s = retry_after_s

    @health_api.get("/")
    def health(self) -> JSONResponse:  # not async: the directory reads block, and FastAPI runs this in a thread
        return health_response(verdict(self._directory), self._retry_after_s)


def health_route(route_prefix: str) -> str:
    return route_prefix.rstrip("/") + "/health"


def build_health_app(args: dict[str, Any]) -> serve.Application:
    """For a Serve config file: args {app: the raypd application's name, retry_after_s (optional)}."""
    unknown = set(args) - {"app", "retry_after_s"}
    if "app" not in args or unknown:
        raise ValueError(f"cluster.serving.health:build_health_app takes args app (required) and retry_after_s; got "
                         f"{sorted(args)}")
    return Health.bind(str(args["app"]), int(args.get("retry_after_s", _RETRY_AFTER_S)))
