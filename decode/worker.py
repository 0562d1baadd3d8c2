"""The decode role: generation-only requests. A Ray actor class (plain Python until ray.remote wraps it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AsyncIterator

import ray

from engine.engine import EngineConfig, LLMEngine
from engine.worker import EngineWorker
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.sampling_params import SamplingParams
from postproc.pipes import PipeAddr
from postproc.routing import PostprocSender
from postproc.worker import PostprocParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PostprocRoute:
    """Where a request's tokens go: the owner's lane index on each postproc worker (worker = request id % count)."""

    lanes: tuple[int, ...]
    streaming: bool = True


class DecodeWorker(EngineWorker):
    """Reads each request's prompt KV from its prefill worker over NIXL, then decodes with continuous batching.
    Tokens go back either on the call itself (generate) or through the postproc workers (generate_via_postproc)."""

    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None):
        self._postproc_addrs = list(postproc_addrs or [])
        self._sender: PostprocSender | None = None  # engine thread only, like its pipes
        self._routed: set[int] = set()  # requests whose responses go to the postproc workers (engine thread)
        super().__init__(model_dir, config)
        self.card()  # start the KV plane now: the first request should not pay for it

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def generate(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                       disaggregated_params: DisaggregatedParams | None) -> AsyncIterator[EngineResponse]:
        """Streams the request's responses; the first tokens are not repeated (the owner has them from prefill).
        Without disaggregated_params the whole request runs here (colocated)."""
        _check_generation_only(disaggregated_params)
        async for rsp in self.stream(request_id, prompt_token_ids, params, disaggregated_params,
                                     echo_first_tokens=False):
            yield rsp

    async def generate_via_postproc(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                                    disaggregated_params: DisaggregatedParams | None, route: PostprocRoute) -> None:
        """Decodes; each step's tokens go to postproc worker `request_id % N`, which pushes text to the owner's
        lane. Returns when the engine is done with the request; cancelling the call aborts it."""
        _check_generation_only(disaggregated_params)
        if not self._postproc_addrs:
            raise ValueError("this decode worker was started without postproc workers")
        if len(route.lanes) != len(self._postproc_addrs):
            raise ValueError(f"route names {len(route.lanes)} lanes for {len(self._postproc_addrs)} postproc workers")

        def accept(engine: LLMEngine) -> None:
            self._sender = self._sender or PostprocSender(self._postproc_addrs)
            lane = route.lanes[request_id % len(route.lanes)]
            self._sender.submit(request_id, params, PostprocParams(lane, tuple(prompt_token_ids)), route.streaming,
                                disaggregated_params)
            self._routed.add(request_id)

        async for _ in self.stream(request_id, prompt_token_ids, params, disaggregated_params,
                                   echo_first_tokens=False, on_accept=accept):
            pass

    # ---- on the engine thread ----
    def _deliver(self, responses: list[EngineResponse]) -> None:
        routed = [r for r in responses if r.request_id in self._routed]
        if routed:
            self._send(routed)
        # a routed request's caller only needs to hear that it ended
        super()._deliver([r for r in responses if r.request_id not in self._routed or r.finished])
        self._routed.difference_update(r.request_id for r in routed if r.finished)

    def _send(self, routed: list[EngineResponse]) -> None:
        try:
            self._sender.send(routed)
        except (TimeoutError, RuntimeError) as exc:  # a postproc worker is gone: fail its requests, keep serving
            log.error("postproc workers unreachable (%s): failing %d request(s)", exc, len(routed))
            for rsp in routed:
                self._routed.discard(rsp.request_id)
                self.loop.engine.abort_request(rsp.request_id)
                self._fail(rsp.request_id, RuntimeError(f"postproc worker {rsp.request_id % len(self._postproc_addrs)} "
                                                        f"is unreachable: {exc}"))


def _check_generation_only(params: DisaggregatedParams | None) -> None:
    # colocated: whole requests, which may bring embedding handles (no request_type but the default)
    if params is not None and params.request_type not in ("generation_only", "context_and_generation"):
        raise ValueError(f"a decode worker takes generation_only or whole requests, got {params.request_type!r}")
