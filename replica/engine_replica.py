"""EngineReplica: an engine replica of any role. An EngineWorker (the engine behind an asyncio API), its control pipe
(where owners send Abort, StopCandidates and Start) and its route to the postproc workers. The prefill and decode roles
are thin adapters that say which kinds of request they take. A Ray actor class (plain Python until Ray wraps it).

One call serves every request, `serve(Submit)` (protocol): first `Accepted`, naming this replica's control pipe, then
the request's responses on the stream itself, or, when the Submit has a route, `Done` once the engine is done with it
(its tokens went to postproc worker `postproc_worker(request_id, N)`, which pushes text to the owner's lane). Serve
gives no handle on one replica; the control pipe is how the owner reaches the replica that holds its request.

An owner that knows the pipe may also send a routed Submit there without a call (`Start`: cluster/owner/direct.py
says when). The replica serves it as the call would and reports what the call would stream, Accepted then Done or the
error, as `Reply` messages to the owner's reply pipe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import AsyncIterator

import ray

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.worker import EngineWorker
from engine.multimodal.embedding_handle import EmbeddingsGone
from llmapi.disaggregated_params import REQUEST_TYPES, RequestType
from llmapi.outputs import RequestDelta
from postproc.pipes import PullPipe, PushPipes, new_pipe_key, tcp_address
from postproc.routing import PostprocSender
from postproc.worker import PostprocParams
from protocol import (Abort, Accepted, Done, PipeAddr, PostprocRoute, PostprocUnreachable, Reply, Start,
                      StopCandidates, Submit)

log = logging.getLogger(__name__)
_CONTROL_POLL_S = 0.1
_REPLY_TIMEOUT_S = 0.5  # a live owner takes a reply at once; an owner gone loses its direct requests


class EngineReplica(EngineWorker):
    """kinds: the request types this replica serves (a role adapter narrows them); replica_name: its Serve replica
    id where it has one, named in Accepted (direct starts find the replica by it)."""

    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None,
                 host: str | None = None, kinds: tuple[RequestType, ...] = REQUEST_TYPES,
                 replica_name: str | None = None):
        self.kinds, self.replica_name = kinds, replica_name
        self._postproc_addrs = list(postproc_addrs or [])
        self._sender: PostprocSender | None = None  # engine thread only, like its pipes
        self._routed: set[int] = set()  # requests whose responses go to the postproc workers (engine thread)
        self._direct: dict[int, PipeAddr] = {}  # request id -> its owner's reply pipe, for each Start (engine thread)
        self._replies = PushPipes()  # to owners' reply pipes (engine thread)
        super().__init__(model_dir, config)
        self.card()  # start the KV plane now: the first request should not pay for it
        self._control = PullPipe((tcp_address(host or _node_ip()), new_pipe_key()))
        self._control_thread = threading.Thread(target=self._serve_control, name="raypd-control", daemon=True)
        self._control_thread.start()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @property
    def postproc_addrs(self) -> tuple[PipeAddr, ...]:
        """The postproc workers' pull pipes this replica sends to, by worker index."""
        return tuple(self._postproc_addrs)

    async def serve(self, submit: Submit) -> AsyncIterator[Accepted | RequestDelta | Done]:
        """Accepted, then the request's responses (no route) or Done (a route). The first tokens of a
        generation-only request are not repeated (the owner has them from prefill); a context-only request yields
        its final response only: first token per candidate, and a Handoff naming the KV blocks unless every
        candidate ended there. Cancelling the call aborts the request. Embeddings that can no longer be read (their
        encoder died, their lease ended) end it with a response whose retry_whole asks the owner to encode the images
        again, whatever the route: nothing of it reached the engine or a postproc worker."""
        self._check(submit)
        yield self._accepted()
        try:
            if submit.route is None:
                async with contextlib.aclosing(self._responses(submit)) as responses:  # closed with this call
                    async for rsp in responses:
                        yield rsp
                return
            async with contextlib.aclosing(self._responses(submit, lambda e: self._route(submit))) as responses:
                async for _ in responses:
                    pass
        except EmbeddingsGone as e:
            yield RequestDelta(submit.request_id, (), finished=True, error=str(e), retry_whole=True)
            return
        yield Done()

    async def _responses(self, submit: Submit, on_accept=None) -> AsyncIterator[RequestDelta]:
        stream = contextlib.aclosing(self.stream(
            submit.request_id, submit.prompt_token_ids, submit.params, submit.disaggregated_params,
            echo_first_tokens=False, on_accept=on_accept, resume=submit.resume))
        if submit.kind != "context_only":
            async with stream as responses:
                async for rsp in responses:
                    yield rsp
            return
        last = None
        try:
            async with stream as responses:
                async for rsp in responses:
                    last = rsp
            yield last
        except BaseException:
            if last is not None and last.handoff is not None:
                self.abort(submit.request_id)  # nobody will read the KV: free it now, not when the lease ends
            raise

    def _check(self, submit: Submit) -> None:
        if submit.kind not in self.kinds:
            raise ValueError(f"this replica serves {' or '.join(self.kinds)} requests, got {submit.kind!r}")
        if submit.route is None:
            return
        if not self._postproc_addrs:
            raise ValueError("this worker was started without postproc workers")
        if len(submit.route.lanes) != len(self._postproc_addrs):
            raise ValueError(f"route names {len(submit.route.lanes)} lanes for {len(self._postproc_addrs)} "
                             "postproc workers")

    def _route(self, submit: Submit) -> None:
        """On the engine thread, once the engine took the request: its responses go to its postproc worker."""
        route: PostprocRoute = submit.route
        resumed = tuple((c.index, c.token_ids) for c in submit.resume.candidates) if submit.resume else ()
        self._sender = self._sender or PostprocSender(self._postproc_addrs)
        params = PostprocParams(route.lane_of(submit.request_id), tuple(submit.prompt_token_ids), resumed)
        self._sender.submit(submit.request_id, submit.params, params, route.streaming, submit.disaggregated_params)
        self._routed.add(submit.request_id)

    def _accepted(self) -> Accepted:
        return Accepted(self._control.addr, self.replica_name)

    def reconnect_postproc(self, worker: int, addr: PipeAddr) -> None:
        """A postproc worker came back with a new pipe: send its requests there from now on."""
        self._postproc_addrs[worker] = addr
        self.loop.post(lambda e: self._sender.reconnect(worker, addr) if self._sender else None)

    # ---- control messages (their own thread; the engine's work is posted to its loop) ----
    def _serve_control(self) -> None:
        while True:
            try:
                msg = self._control.get(timeout=_CONTROL_POLL_S)
            except TimeoutError:
                continue
            except RuntimeError:  # the pipe was closed: the replica is going away
                return
            if isinstance(msg, Abort):
                self.abort(msg.request_id)
            elif isinstance(msg, StopCandidates):
                self.stop_candidates(msg.request_id, list(msg.indices))
            elif isinstance(msg, Start):
                self._start(msg)

    def _start(self, msg: Start) -> None:
        """Serves a Start as serve() serves a routed call; the engine thread reports to the owner."""
        submit = msg.submit
        request_id, dp = submit.request_id, submit.disaggregated_params
        try:
            self._check(submit)
            if dp is not None and dp.multimodal_embedding_handles:
                raise ValueError("a request with images is served by a call (its embeddings are read there)")
            ids = self.prepare_now(submit.prompt_token_ids, dp).token_ids
        except ValueError as exc:
            self.loop.post(lambda e, error=exc: self._reply(msg.reply, request_id, error))
            return

        def start(e: LLMEngine) -> None:
            try:
                e.add_request(request_id, ids, submit.params, dp, False)
            except ValueError as exc:
                self._reply(msg.reply, request_id, exc)
                return
            self._latency.accept(request_id)
            self._route(submit)
            self._direct[request_id] = msg.reply
            self._reply(msg.reply, request_id, self._accepted())
        self.loop.post(start)

    def abort(self, request_id: int) -> None:
        def end(e: LLMEngine) -> None:
            self._direct.pop(request_id, None)  # its owner asked: it needs no reply
            e.abort_request(request_id)
        self.loop.post(end)

    def shutdown(self) -> None:
        self._control.close()
        super().shutdown()
        self._replies.close()

    # ---- on the engine thread ----
    def _deliver(self, responses: list[RequestDelta]) -> None:
        routed = [r for r in responses if r.request_id in self._routed]
        if routed:
            self._send(routed)
        # a routed request's caller only needs to hear that it ended
        super()._deliver([r for r in responses if r.request_id not in self._routed or r.final])
        for rsp in routed:
            if rsp.final:
                self._routed.discard(rsp.request_id)
                reply = self._direct.pop(rsp.request_id, None)
                if reply is not None:
                    self._reply(reply, rsp.request_id, Done())

    def _fail(self, request_id: int, exc: BaseException) -> None:
        reply = self._direct.pop(request_id, None)
        if reply is not None:
            self._reply(reply, request_id, exc)
        super()._fail(request_id, exc)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._direct):
            self._fail(request_id, RuntimeError(f"the engine failed: {exc!r}"))
        super()._fail_all(exc)

    def _reply(self, addr: PipeAddr, request_id: int, item) -> None:
        try:
            self._replies.get(addr).put(Reply(request_id, item), timeout=_REPLY_TIMEOUT_S)
        except TimeoutError:  # the owner is gone (its ingress replica died): so are its requests
            log.warning("the owner of request %d takes no replies: its direct requests are aborted", request_id)
            self._replies.drop(addr)
            for rid in [rid for rid, a in self._direct.items() if tuple(a) == tuple(addr)] + [request_id]:
                self._direct.pop(rid, None)
                self.loop.engine.abort_request(rid)

    def _send(self, routed: list[RequestDelta]) -> None:
        for request_id in set(self._sender.send(routed)):  # its postproc worker is gone: fail it, keep serving
            self._routed.discard(request_id)
            self.loop.engine.abort_request(request_id)
            self._fail(request_id, PostprocUnreachable(
                f"postproc worker {self._sender.worker_of(request_id)} takes no messages"))


def _node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
