"""build_app: the Ray Serve application of one deployment YAML; deploy: it and its /health application.

    serve run configs/serve.yaml     # both applications; or: raypd serve configs/local.yaml
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray import serve
from ray.experimental import internal_kv

from cluster.config import RaypdConfig, Role, load_config, parse_config
from cluster.serving.health import Health, health_route
from cluster.edge.ingress import Ingress
from cluster.serving.replicas import DRAIN_MARGIN_S, DecodeReplica, EncoderReplica, PrefillReplica
from cluster.routing.request_router import router_config
from postproc.actor import PostprocActor

_KEY_NAME = b"raypd/cluster_key"
_START_TIMEOUT_S = 120.0
_SERVE_SHUTDOWN_S = 5.0  # Serve's own part of stopping a replica, past the user's __del__
POSTPROC_NAMESPACE = "raypd"
POSTPROC_PREFIX = "raypd-postproc-"  # worker i is the actor named POSTPROC_PREFIX + str(i) in POSTPROC_NAMESPACE


def build_app(args: dict[str, Any]) -> serve.Application:
    """args: {"config": PATH} (a deployment YAML) or the YAML's keys themselves. A bad config fails here, before
    anything starts, naming the field."""
    config = load_config(args["config"]) if set(args) == {"config"} else parse_config(dict(args), "app args")
    if not ray.is_initialized():
        # `serve run` builds the app before it connects to Ray, but building needs Ray (the cluster key, the postproc
        # workers); it then reuses this connection. RAY_ADDRESS picks a cluster, else Ray starts here.
        ray.init(namespace="serve")
    return build_from_config(config)


def deploy(config: RaypdConfig, name: str, route_prefix: str = "/", logging_config: dict | None = None) -> None:
    """Deploys raypd's application and its /health (cluster.serving.health, answered in a replica of its own) side by
    side, and returns once both run."""
    health = Health.bind(name, config.limits.retry_after_s)
    serve.run_many([serve.RunTarget(build_from_config(config), name, route_prefix, logging_config),
                    serve.RunTarget(health, f"{name}-health", health_route(route_prefix), logging_config)])


def build_from_config(config: RaypdConfig) -> serve.Application:
    key = cluster_key()
    postprocs = start_postprocs(config)
    ray.get([p.pull_pipe_addr.remote() for p in postprocs], timeout=_START_TIMEOUT_S)  # all started
    routing = router_config(config.router.policy.value)
    extra = {"request_router_config": routing} if routing is not None else {}
    # A stopping prefill replica waits for its leased KV to be read (replicas.drain): Serve must not kill it sooner.
    prefill = serve.deployment(PrefillReplica, name="prefill").options(
        **one_loop_options(config.prefill), **extra,
        graceful_shutdown_timeout_s=config.engine.kv_lease_s + DRAIN_MARGIN_S + _SERVE_SHUTDOWN_S)
    decode = serve.deployment(DecodeReplica, name="decode").options(**one_loop_options(config.decode), **extra)
    ingress_options = one_loop_options(config.ingress)
    if "max_ongoing_requests" not in config.ingress.model_fields_set:
        # The ingress sheds load itself (429 at once): Serve must hand it every request, and /health, without a queue.
        ingress_options["max_ongoing_requests"] = config.limits.max_requests_in_flight + 1024
    ingress = Ingress.options(name="ingress", **ingress_options)
    # The key is read here, where the config was loaded: an api_key_env variable need not exist on replica nodes.
    # Roles' scaling is left out of the ingress's arguments: a redeploy that only rescales then changes no replica's
    # arguments, and Serve adds or removes replicas without restarting the others.
    ingress_config = config.model_copy(update={role: Role() for role in ("prefill", "decode", "postproc", "ingress",
                                                                           "encoder")})
    prefill_app = None if config.mode == "colocated" else prefill.bind(
        config.model, config.engine_config(key, "prefill"), postprocs)
    return ingress.bind(ingress_config, prefill_app, decode.bind(config.model, config.engine_config(key, "decode"),
                                                                 postprocs),
                        config.http.api_key_value(), postprocs, encoder_app(config, key))


def one_loop_options(role: Role) -> dict:
    """A deployment's options with its replicas running our code on the event loop that serves their calls (HTTP
    requests too, for the ingress). Serve's default puts it on a second loop in a thread of its own, and every call,
    streamed item and SSE chunk then crosses between the two. Measured side by side at 16 streams: +10% output tok/s,
    -15-20% TTFT p50 for the engine roles; for the ingress +8% tok/s at 16 streams and -15% TTFT p50 at 1 (docs/
    performance.md). The ingress could do this once /health was answered by an application of its own (a flood the
    ingress sheds still passes through its loop)."""
    options = role.deployment_options()
    env = options["ray_actor_options"].setdefault("runtime_env", {}).setdefault("env_vars", {})
    env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "0"
    return options


def encoder_app(config: RaypdConfig, key: bytes):
    """The encoder deployment, only for a model with a vision tower (load_vision_spec refuses unsupported towers by
    name here, before anything starts)."""
    from engine.multimodal.vision import load_vision_spec

    if not config.has_vision_tower or load_vision_spec(config.model) is None:
        return None
    encoder = serve.deployment(EncoderReplica, name="encoder").options(
        **config.encoder.deployment_options(),  # a stopping one waits for its leased embeddings to be read
        graceful_shutdown_timeout_s=config.multimodal.embedding_lease_s + DRAIN_MARGIN_S + _SERVE_SHUTDOWN_S)
    return encoder.bind(config.model, config.encoder_config(key))


def start_postprocs(config: RaypdConfig) -> list:
    """The postproc workers: named, detached actors, so every decode and ingress replica (and a later redeploy)
    finds the same ones. Their count is fixed: requests go to worker `request id % count`. Ray restarts one that
    dies (a new pipe; replicas and owners follow it there)."""
    actor = ray.remote(PostprocActor)
    role = config.postproc
    options = dict(num_cpus=role.num_cpus or 0, num_gpus=role.num_gpus, resources=dict(role.resources),
                   lifetime="detached", get_if_exists=True, namespace=POSTPROC_NAMESPACE, max_restarts=-1)
    return [actor.options(name=f"{POSTPROC_PREFIX}{i}", **options).remote(config.model, config.post_processor_hook)
            for i in range(config.num_postprocess_workers)]


def cluster_key() -> bytes:
    """The key that signs KV handles, the same for every build on this Ray cluster: redeploying with new replica
    counts then changes nothing else, so Serve rescales in place instead of restarting every replica."""
    key = internal_kv._internal_kv_get(_KEY_NAME)
    if key is None:
        internal_kv._internal_kv_put(_KEY_NAME, os.urandom(32), overwrite=False)
        key = internal_kv._internal_kv_get(_KEY_NAME)
    return key
