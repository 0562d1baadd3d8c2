"""EdgeGate (cluster/edge/checks.py), the ASGI middleware every request meets first, around a streaming app: a client
that leaves mid-stream (Serve's receive then raises TaskCancelledError) ends the stream quietly, as an ASGI disconnect
would, instead of failing the request's task (which Serve logs as "Task exception was never retrieved")."""

from __future__ import annotations

import asyncio

from ray.exceptions import TaskCancelledError
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from cluster.edge.checks import EdgeGate


async def _tokens(request):
    async def chunks():
        for i in range(10_000):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.005)

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _serve_one(leave_after_s: float) -> list[dict]:
    """One POST through EdgeGate into the app; the client leaves after leave_after_s. Returns what was sent."""
    app = Starlette(routes=[Route("/v1/stream", _tokens, methods=["POST"])])
    sent: list[dict] = []
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(leave_after_s)
        raise TaskCancelledError(error_message="the client left")  # what Serve's receive raises then

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/stream", "headers": [], "query_string": b"",
             "app": app, "asgi": {"version": "3.0"}}
    asyncio.run(asyncio.wait_for(EdgeGate(app)(scope, receive, send), 10))
    return sent


def test_a_client_that_leaves_mid_stream_ends_the_stream_without_an_error():
    sent = _serve_one(leave_after_s=0.1)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert 1 <= len(bodies) < 10_000  # it streamed, then stopped when the client left
