"""The request owner: creates each request's GenerationResult, runs it prefill -> decode, post-processes what comes
back into it. Where the roles live is behind `Roles`: plain Ray actors (ActorRoles) or Serve deployments (ServeRoles).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import uuid
from typing import AsyncIterator, Callable, Protocol

from llmapi.detokenized import DetokenizedGenerationResultBase
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse, TokenDelta
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Roles(Protocol):
    """How an owner reaches the prefill and decode workers. Every call has the owner's deadline around it.
    colocated: there is no prefill role; decode workers serve whole requests (params None below)."""

    colocated: bool

    async def prefill(self, result: RequestOutput) -> EngineResponse:
        """The context-only response of a prefill worker it picked: first tokens, and a Handoff unless every
        candidate ended there."""

    def decode(self, result: RequestOutput, params: DisaggregatedParams | None) -> AsyncIterator[EngineResponse]:
        """The responses of a decode worker it picked; the first tokens are not repeated."""

    async def decode_via_postproc(self, result: RequestOutput, params: DisaggregatedParams,
                                  lanes: tuple[int, ...]) -> None:
        """Decodes on a worker that pushes the tokens to the postproc workers (lane index per worker); returns when
        the engine is done. Needed only by owners that have lanes."""

    def release(self, params: DisaggregatedParams) -> None:
        """Frees the prefill side's blocks of a request that will not be decoded (via any decode worker)."""

    def stop(self, request_id: int, indices: list[int], finished: bool) -> None:
        """Candidates ended by post-processing (stop string); finished: the whole request is done."""

    def abort(self, request_id: int) -> None:
        """Stops the request wherever it is and frees its blocks."""


class RequestOwner:
    """lanes: this owner's lane index on each postproc worker. With lanes, decoded tokens come back through the
    postproc workers (detokenized there) to on_output(); without, the owner post-processes the decode stream itself.
    local_prefill: conditional disaggregation (cluster/local_prefill.py): True for a request to prefill on its decode
    replica (no KV transfer)."""

    def __init__(self, roles: Roles, tokenizer, request_timeout_s: float = 300.0, lanes: tuple[int, ...] = (),
                 local_prefill: Callable[[RequestOutput], bool] | None = None):
        self.roles = roles
        self.local_prefill = local_prefill
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self.lanes = tuple(lanes)
        self._ids = itertools.count(uuid.uuid4().int >> 80)  # unique across owners that share workers
        self._via_lane: dict[int, tuple[RequestOutput, asyncio.Event]] = {}

    def create(self, prompt: str | list[int], params: SamplingParams, streaming: bool = False, text: str | None = None,
               ) -> tuple[RequestOutput, DetokenizedGenerationResultBase]:
        """A new request's result and its post-processing record; run() then serves it. `text`: the prompt's text
        when `prompt` is already tokenized."""
        params = copy.deepcopy(params)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        request_id = next(self._ids)
        result = RequestOutput(request_id, ids, params, text, streaming, abort_fn=self.roles.abort)
        return result, DetokenizedGenerationResultBase(request_id, ids, params, self.tokenizer, streaming)

    async def run(self, result: RequestOutput, record: DetokenizedGenerationResultBase) -> None:
        """Serves one request to its end; every failure reaches the result as an error that says where."""
        try:
            await asyncio.wait_for(self._serve(result, record), self.request_timeout_s)
        except asyncio.TimeoutError:
            self.roles.abort(result.request_id)
            result.put(RequestError(f"request {result.request_id} did not finish within {self.request_timeout_s} s"))
        except Exception as exc:
            result.put(exc if isinstance(exc, (ValueError, RequestError)) else RequestError(str(exc)))

    async def _serve(self, result: RequestOutput, record: DetokenizedGenerationResultBase) -> None:
        if self.roles.colocated or (self.local_prefill is not None and self.local_prefill(result)):
            await self._generate(result, record, None)
            return
        ctx = await self.roles.prefill(result)
        if ctx.error is not None:
            raise RequestError(ctx.error)
        if self._deliver(result, record, ctx) or ctx.handoff is None:
            return  # every candidate ended with its first token; the prefill engine has freed the blocks
        if result.aborted():  # the client left while its prompt was prefilled: nobody will read the KV
            self.roles.release(ctx.handoff.generation_params())
            self._deliver(result, record, _cancelled(result))
            return
        await self._generate(result, record, ctx.handoff.generation_params())

    async def _generate(self, result: RequestOutput, record, params: DisaggregatedParams | None) -> None:
        """Decodes on a decode worker: from the prefill side's KV (params), or the whole request (None)."""
        if self.lanes:
            await self._decode_via_postproc(result, params)
            return
        async for rsp in self.roles.decode(result, params):
            if self._deliver(result, record, rsp):
                return
        if not record.finished:
            raise RequestError(f"the decode worker ended request {result.request_id} without a final response")

    async def _decode_via_postproc(self, result: RequestOutput, params: DisaggregatedParams) -> None:
        """Decoding runs on a decode worker; its text arrives on this owner's lane. Done when the final output has
        arrived; the decode call is cancelled if post-processing ended the request first (stop string)."""
        done = asyncio.Event()
        self._via_lane[result.request_id] = (result, done)
        call = asyncio.ensure_future(self.roles.decode_via_postproc(result, params, self.lanes))
        final = asyncio.ensure_future(done.wait())
        try:
            await asyncio.wait({call, final}, return_when=asyncio.FIRST_COMPLETED)
            if call.done() and not call.cancelled() and call.exception() is not None:
                raise call.exception()
            await final  # the engine is done; its last output may still be on its way through postproc
        finally:
            call.cancel()
            final.cancel()
            self._via_lane.pop(result.request_id, None)

    def on_output(self, out) -> None:
        """One postproc Output for a request of this owner (on the owner's event loop)."""
        entry = self._via_lane.get(out.client_id)
        if entry is None:
            return
        result, done = entry
        if out.res is not None:
            result.put(out.res)
        if out.is_final:
            done.set()
        elif out.should_abort:
            self.roles.stop(out.client_id, list(out.should_abort), False)

    def _deliver(self, result: RequestOutput, record: DetokenizedGenerationResultBase, rsp: EngineResponse) -> bool:
        """Post-processes one response into the result; True once the request is finished."""
        delta, to_stop = record.handle(rsp)
        if to_stop:
            self.roles.stop(rsp.request_id, to_stop, record.finished)
        if delta is not None:
            result.put(delta)
        return record.finished


def _cancelled(result: RequestOutput) -> EngineResponse:
    """The request's end when the owner stops it between roles: every unfinished candidate is cancelled."""
    deltas = tuple(TokenDelta(o.index, (), o.cumulative_logprob or 0.0, finish_reason="cancelled")
                   for o in result.outputs if o.finish_reason is None)
    return EngineResponse(result.request_id, deltas, finished=True)
