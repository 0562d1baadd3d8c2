"""The decode role: generation-only requests (and whole ones). A Ray actor class (plain Python until Ray wraps it).

Every call that serves a request streams: first `Accepted`, naming this replica's control pipe (where the owner sends
`Abort` and `StopCandidates` for it, whatever happens to the call itself), then the request's responses. Serve gives no
handle on one replica; the control pipe is how the owner reaches the replica that holds its request.

An owner that knows the pipe may also send a request there without a call (`Start`: cluster/owner/direct.py says when).
The replica serves it as generate_via_postproc would and reports what that call would stream, Accepted then Done or
the error, as `Reply` messages to the owner's reply pipe.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator

import ray

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.worker import EngineWorker
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse, Resume
from llmapi.sampling_params import SamplingParams
from postproc.pipes import PipeAddr, PullPipe, PushPipes, new_pipe_key, tcp_address
from postproc.routing import PostprocSender
from postproc.worker import PostprocParams

log = logging.getLogger(__name__)
_CONTROL_POLL_S = 0.1
_REPLY_TIMEOUT_S = 0.5  # a live owner takes a reply at once; an owner gone loses its direct requests


@dataclass(frozen=True)
class Accepted:
    """A replica took a request: its control pipe, for the owner's Abort, StopCandidates and Start; replica: its
    Serve replica id where it has one (cluster/owner/direct.py matches pipes to the replica directory by it)."""

    control: PipeAddr
    replica: str | None = None


@dataclass(frozen=True)
class Done:
    """The engine is done with a request whose tokens went through the postproc workers."""


@dataclass(frozen=True)
class Abort:
    request_id: int


@dataclass(frozen=True)
class StopCandidates:
    request_id: int
    indices: tuple[int, ...]


class PostprocUnreachable(RuntimeError):
    """The postproc worker of a request takes no messages; its owner resumes the request elsewhere."""


@dataclass(frozen=True)
class PostprocRoute:
    """Where a request's tokens go: the owner's lane index on each postproc worker (worker = request id % count)."""

    lanes: tuple[int, ...]
    streaming: bool = True


@dataclass(frozen=True)
class Start:
    """A request for generate_via_postproc without the call: text or generation-only (no images to read)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    disaggregated_params: DisaggregatedParams | None
    route: PostprocRoute
    reply: PipeAddr  # the owner's reply pipe


@dataclass(frozen=True)
class Reply:
    """What the call would have streamed for a Start: Accepted, Done, or the exception it would have raised."""

    request_id: int
    item: Accepted | Done | Exception


class DecodeWorker(EngineWorker):
    """Reads each request's prompt KV from its prefill worker over NIXL, then decodes with continuous batching.
    Tokens go back either on the call itself (generate) or through the postproc workers (generate_via_postproc).
    Whole requests (no disaggregated_params) run here entirely: colocated mode, and the owner's fallback."""

    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None,
                 host: str | None = None):
        self._postproc_addrs = list(postproc_addrs or [])
        self._sender: PostprocSender | None = None  # engine thread only, like its pipes
        self._routed: set[int] = set()  # requests whose responses go to the postproc workers (engine thread)
        self._direct: dict[int, PipeAddr] = {}  # request id -> its owner's reply pipe, for each Start (engine thread)
        self._replies = PushPipes()  # to owners' reply pipes (engine thread)
        self.replica_name: str | None = None  # its Serve replica id, named in Accepted
        super().__init__(model_dir, config)
        self.card()  # start the KV plane now: the first request should not pay for it
        self._control = PullPipe((tcp_address(host or _node_ip()), new_pipe_key()))
        self._control_thread = threading.Thread(target=self._serve_control, name="raypd-control", daemon=True)
        self._control_thread.start()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def generate(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                       disaggregated_params: DisaggregatedParams | None, resume: Resume | None = None
                       ) -> AsyncIterator[Accepted | EngineResponse]:
        """Accepted, then the request's responses; the first tokens are not repeated (the owner has them from
        prefill). Without disaggregated_params the whole request runs here (colocated)."""
        _check_generation_only(disaggregated_params)
        yield self._accepted()
        async for rsp in self.stream(request_id, prompt_token_ids, params, disaggregated_params,
                                     echo_first_tokens=False, resume=resume):
            yield rsp

    async def generate_via_postproc(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                                    disaggregated_params: DisaggregatedParams | None, route: PostprocRoute,
                                    resume: Resume | None = None) -> AsyncIterator[Accepted | Done]:
        """Accepted, then Done when the engine is done with the request; its tokens go to postproc worker
        `request_id % N`, which pushes text to the owner's lane. Cancelling the call aborts the request."""
        self._check_route(disaggregated_params, route)
        yield self._accepted()
        resumed = tuple((c.index, c.token_ids) for c in resume.candidates) if resume else ()

        def accept(engine: LLMEngine) -> None:
            self._route(request_id, params, prompt_token_ids, disaggregated_params, route, resumed)

        async for _ in self.stream(request_id, prompt_token_ids, params, disaggregated_params,
                                   echo_first_tokens=False, on_accept=accept, resume=resume):
            pass
        yield Done()

    def _check_route(self, params: DisaggregatedParams | None, route: PostprocRoute) -> None:
        _check_generation_only(params)
        if not self._postproc_addrs:
            raise ValueError("this worker was started without postproc workers")
        if len(route.lanes) != len(self._postproc_addrs):
            raise ValueError(f"route names {len(route.lanes)} lanes for {len(self._postproc_addrs)} postproc workers")

    def _route(self, request_id: int, params: SamplingParams, prompt_token_ids: list[int],
               disaggregated_params: DisaggregatedParams | None, route: PostprocRoute, resumed: tuple) -> None:
        """On the engine thread, once the engine took the request: its responses go to its postproc worker."""
        self._sender = self._sender or PostprocSender(self._postproc_addrs)
        lane = route.lanes[request_id % len(route.lanes)]
        self._sender.submit(request_id, params, PostprocParams(lane, tuple(prompt_token_ids), resumed),
                            route.streaming, disaggregated_params)
        self._routed.add(request_id)

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
        """Serves a Start as generate_via_postproc serves its call; the engine thread reports to the owner."""
        request_id, dp = msg.request_id, msg.disaggregated_params
        try:
            self._check_route(dp, msg.route)
            if dp is not None and dp.multimodal_embedding_handles:
                raise ValueError("a request with images is served by a call (its embeddings are read there)")
            generation_only = dp is not None and dp.request_type == "generation_only"
            ids = list(msg.prompt_token_ids) if generation_only else self.images.text(msg.prompt_token_ids).token_ids
        except ValueError as exc:
            self.loop.post(lambda e, error=exc: self._reply(msg.reply, request_id, error))
            return

        def start(e: LLMEngine) -> None:
            try:
                e.add_request(request_id, ids, msg.params, dp, False)
            except ValueError as exc:
                self._reply(msg.reply, request_id, exc)
                return
            self._latency.accept(request_id)
            self._route(request_id, msg.params, msg.prompt_token_ids, dp, msg.route, ())
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
    def _deliver(self, responses: list[EngineResponse]) -> None:
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

    def _send(self, routed: list[EngineResponse]) -> None:
        for request_id in set(self._sender.send(routed)):  # its postproc worker is gone: fail it, keep serving
            self._routed.discard(request_id)
            self.loop.engine.abort_request(request_id)
            self._fail(request_id, PostprocUnreachable(
                f"postproc worker {self._sender.worker_of(request_id)} takes no messages"))


def _node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _check_generation_only(params: DisaggregatedParams | None) -> None:
    # colocated: whole requests, which may bring embedding handles (no request_type but the default)
    if params is not None and params.request_type not in ("generation_only", "context_and_generation"):
        raise ValueError(f"a decode worker takes generation_only or whole requests, got {params.request_type!r}")
