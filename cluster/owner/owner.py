"""The request owner: creates each request's GenerationResult, runs it prefill -> decode, post-processes what comes
back into it, and survives the loss of the workers on the way. Where the roles live is behind `Roles`: plain Ray actors
(ActorRoles) or Serve deployments (ServeRoles).

Every role call streams `Accepted` first (the replica's control pipe, where Abort and StopCandidates go). A lost
prefill worker, or one that could not read the images' embeddings (their encoder died): the request is served whole on
a decode worker, with fresh embeddings. A lost decode worker (or postproc worker), or one that could not read the
prompt's KV and cannot compute the prompt itself (images whose embeddings only the prefill side read), or could not
read the embeddings: the request is resumed from its candidates' tokens so far on another decode worker, or whole on a
prefill worker when no decode worker takes it; draws depend only on (seed, candidate, position), so the stream goes on
with the tokens it would have had. An encoder lost during its call is called again. A bounded number of times, then a
clear error naming the role.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from cluster.owner.control import ControlClient, Holders
from cluster.owner.direct import DirectStarts, ReplicaGone
from cluster.owner.lanes import LaneWaits, PostprocLost, PromptInputsLost, retry_whole
from cluster.routing.local_prefill import OwnerLoad
from llmapi.disaggregated_params import DisaggregatedParams, RequestType
from llmapi.outputs import RequestDelta, Resume, ResumedCandidate, TokenDelta
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams
from postproc.detokenized import DetokenizedGenerationResultBase
from postproc.sink import ResultSink
from protocol import Accepted, Done, PostprocRoute, PostprocUnreachable, Submit

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # calls to decode a request, the first included
ACCEPT_TIMEOUT_S = 5.0  # a role call that no replica accepts within this counts as that role being down


class NotAccepted(RuntimeError):
    """No replica of a role took the call in time."""


LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, PostprocLost, PostprocUnreachable,
        NotAccepted, ReplicaGone, PromptInputsLost)


class Roles(Protocol):
    """How an owner reaches the workers. role: "prefill" or "decode" (a prefill worker serves whole requests too).
    colocated: there is no prefill role."""

    colocated: bool

    async def encode(self, result: RequestOutput, images: tuple) -> DisaggregatedParams:
        """The embedding handles and content hashes of the request's images (engine.multimodal.processing.ImageItem,
        decoded and hashed by the owner), from an encoder worker it picked."""

    def call(self, role: str, submit: Submit) -> AsyncIterator[Accepted | RequestDelta | Done]:
        """A replica of the role serves the Submit (EngineReplica.serve): Accepted, then the responses, or Done
        when the Submit has a route."""


class Lanes(Protocol):
    """The owner's lane on the postproc workers (cluster.owner.lanes.OwnerLanes)."""

    def route(self, streaming: bool) -> PostprocRoute | None:
        """Where a new request's tokens go, or None while a postproc worker is down (serve it directly)."""


@dataclass(eq=False)
class _Serving:
    """One request while the owner serves it."""

    result: RequestOutput
    record: DetokenizedGenerationResultBase  # post-processing when tokens come straight from the engine
    engine_id: int  # the request's id on the engines; a resumed request gets a new one
    images: tuple = ()  # the prompt's images (engine.multimodal.processing.ImageItem), its placeholders expanded
    holders: Holders | None = None  # the replicas holding it, by role
    serving_role: str = "decode"
    direct: bool = False  # tokens come straight from the engine, not through the postproc workers
    sink: ResultSink | None = None  # where its output lands; stops go to the replica serving it


class RequestOwner:
    """lanes: with them, decoded tokens come back through the postproc workers (detokenized there) to its LaneWaits;
    without, the owner post-processes the decode stream itself. local_prefill: conditional disaggregation
    (cluster/routing/local_prefill.py): called with a request and what else this owner serves; True to serve the request
    whole on a decode replica (no KV transfer). direct: an idle owner's way to a decode replica without a Serve
    call (cluster/owner/direct.py); the ingress sets it once its event loop runs."""

    def __init__(self, roles: Roles, tokenizer, request_timeout_s: float = 300.0, lanes: Lanes | None = None,
                 local_prefill: Callable[[RequestOutput, OwnerLoad], bool] | None = None):
        self.roles = roles
        self.local_prefill = local_prefill
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self.lanes = lanes
        self.control = ControlClient()
        self._ids = itertools.count(uuid.uuid4().int >> 80)  # unique across owners that share workers
        self._serving: dict[int, _Serving] = {}  # result id -> state
        self.waits = LaneWaits()  # requests whose tokens come back on the lane (lanes.on_output feeds it)
        self.direct: DirectStarts | None = None
        self.counters = {"resumed": 0, "prefill_lost": 0, "local_prefill": 0, "direct_start": 0}
        self._prefill_backlog = 0  # prompt tokens of this owner's requests waiting at prefill replicas
        self._loop: asyncio.AbstractEventLoop | None = None  # the owner's event loop: all its state lives there

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
        result = RequestOutput(request_id, ids, params, text, streaming, abort_fn=self.abort)
        return result, self._record(result)

    def _record(self, result: RequestOutput) -> DetokenizedGenerationResultBase:
        return DetokenizedGenerationResultBase(result.request_id, result.prompt_token_ids, result.sampling_params,
                                               self.tokenizer, result.streaming)

    async def run(self, result: RequestOutput, record: DetokenizedGenerationResultBase, images: tuple = ()) -> None:
        """Serves one request to its end; every failure reaches the result as an error that says where. images:
        the prompt's images (engine.multimodal.processing.ImageItem), whose placeholders result.prompt_token_ids has
        expanded."""
        self._loop = asyncio.get_running_loop()
        s = self._serving[result.request_id] = _Serving(result, record, result.request_id, tuple(images))
        s.holders = Holders(self.control)
        s.sink = ResultSink(result, lambda indices: s.holders.stop(s.serving_role, indices))
        try:
            await asyncio.wait_for(self._serve(s), self.request_timeout_s)
        except asyncio.TimeoutError:
            self.abort(result.request_id)
            result.put(RequestError(f"request {result.request_id} did not finish within {self.request_timeout_s} s"))
        except Exception as exc:
            exc = getattr(exc, "cause", None) or exc  # a worker's own error, not Ray's wrapper (pids, tracebacks)
            result.put(exc if isinstance(exc, (ValueError, RequestError)) else RequestError(str(exc)))
        finally:
            del self._serving[result.request_id]

    def abort(self, request_id: int) -> None:
        """The client is gone: every replica holding the request frees it (blocks, leases), at whatever stage.
        Callable from any thread."""
        if self._loop is not None and _running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        s = self._serving.get(request_id)
        if s is not None:
            s.holders.abort_all()

    # ---- the stages ----
    async def _serve(self, s: _Serving) -> None:
        # Read as the request starts, in its own task: the prompts of a batch see those started before them.
        load = OwnerLoad(len(self._serving) - 1, self._prefill_backlog)
        params = None
        if not self.roles.colocated and not self._local(s, load):
            tokens = len(s.result.prompt_token_ids)
            self._prefill_backlog += tokens
            try:
                params = await self._prefill(s)
            finally:
                self._prefill_backlog -= tokens
            if params is False:
                return
        await self._decode(s, params)  # params None: whole on a decode worker

    def _local(self, s: _Serving, load: OwnerLoad) -> bool:
        """Conditional disaggregation: a prompt with little left to prefill after its best prefix hit, or one that
        arrives while the prefill role is backed up or while this owner serves nothing else, is served whole on a
        decode worker, the path a lost prefill role takes too."""
        if self.local_prefill is None or not self.local_prefill(s.result, load):
            return False
        self.counters["local_prefill"] += 1
        return True

    async def _prefill(self, s: _Serving) -> DisaggregatedParams | None | bool:
        """The generation-only params to decode with; None: decode it whole (prefill role lost); False: done."""
        ctx = None
        # Images go to an encoder first; only their handles travel on (DESIGN.md, "One request, end to end").
        images = await self._encode(s) if s.images else None
        try:
            async for item in _accepted_within(self.roles.call("prefill", _submit(s, _with_images(images, "context_only"))),
                                               ACCEPT_TIMEOUT_S):
                if isinstance(item, Accepted):
                    self._hold(s, "prefill", item)
                else:
                    ctx = item
        except LOST as exc:
            self.counters["prefill_lost"] += 1
            log.warning("request %d: %s; it is prefilled on a decode worker instead", s.result.request_id,
                        _lost("prefill", exc))
            return None
        if ctx is None:
            raise RequestError(f"the prefill worker ended request {s.result.request_id} without a response")
        if ctx.retry_whole:  # its images' embeddings could not be read there: fresh ones, served whole on decode
            self.counters["prefill_lost"] += 1
            log.warning("request %d: %s; it is served whole on a decode worker", s.result.request_id, ctx.error)
            return None
        if ctx.error is not None:
            raise RequestError(ctx.error)
        if self._deliver(s, ctx) or ctx.handoff is None:
            return False  # every candidate ended with its first token; the prefill engine has freed the blocks
        if s.result.aborted():  # the client left during prefill; its Abort ended the lease
            self._deliver(s, _cancelled(s))
            return False
        return ctx.handoff.generation_params()

    async def _decode(self, s: _Serving, params: DisaggregatedParams | None) -> None:
        role, resume, last_error = "decode", None, ""
        if params is None and s.images:
            params = await self._whole(s)
        for attempt in range(MAX_ATTEMPTS):
            try:
                await self._generate(s, role, params, resume)
                return
            except LOST as exc:
                if s.result.aborted():
                    self._deliver(s, _cancelled(s))
                    return
                taken = s.holders.took(role, s.engine_id)
                last_error = _lost(role, exc)
                if isinstance(exc, (PostprocLost, PostprocUnreachable)):
                    s.direct = True  # its postproc path failed: the rest comes straight to this owner
                resume = _resume(s, next(self._ids), self._record(s.result))
                if resume is None:
                    return
                params = await self._whole(s) if s.images else None
                self.counters["resumed"] += 1
                # A role whose replica did not even take the call is down for now: the other role serves it
                # whole (every engine can). A call that was taken and then lost is tried on the same role again.
                if not taken and not self.roles.colocated:
                    role = "prefill" if role == "decode" else "decode"
                log.warning("request %d: %s; resuming it on a %s worker (attempt %d of %d)", s.result.request_id,
                            last_error, role, attempt + 2, MAX_ATTEMPTS)
        raise RequestError(f"request {s.result.request_id} could not be finished: {last_error} "
                           f"({MAX_ATTEMPTS} attempts)")

    async def _generate(self, s: _Serving, role: str, params: DisaggregatedParams | None,
                        resume: Resume | None) -> None:
        route = self.lanes.route(s.result.streaming) if self.lanes is not None and not s.direct else None
        s.serving_role = role
        if route is not None:
            await self._via_postproc(s, role, params, resume, route)
            return
        stream = self.roles.call(role, _submit(s, params, resume))
        async for item in _accepted_within(stream, ACCEPT_TIMEOUT_S):
            if isinstance(item, Accepted):
                self._hold(s, role, item)
            elif (lost := retry_whole(item)) is not None:
                raise lost
            elif self._deliver(s, item):
                return
        if not s.record.finished:
            raise RequestError(f"the {role} worker ended request {s.result.request_id} without a final response")

    async def _via_postproc(self, s: _Serving, role: str, params, resume, route: PostprocRoute) -> None:
        """The engine's tokens come back on this owner's lane (LaneWaits); a request whose final output did not
        arrive is released on its replica."""
        submit = _submit(s, params, resume, route)
        stream = self._direct_start(s, role, submit) or self.roles.call(role, submit)
        arrived = False
        try:
            await self.waits.wait(s.engine_id, s.sink, self._follow(s, role, stream), len(route.lanes))
            arrived = True
        finally:
            if not arrived:
                s.holders.release(role, s.engine_id)

    def _direct_start(self, s: _Serving, role: str, submit: Submit) -> AsyncIterator[Accepted | Done] | None:
        """The request's first decode call, made straight to a decode replica's pipe while this owner serves
        nothing else (cluster/owner/direct.py); None: call through the roles."""
        idle = len(self._serving) == 1
        if self.direct is None or role != "decode" or submit.resume is not None or s.images or not idle:
            return None
        target = self.direct.choose(s.result.prompt_token_ids, s.result.sampling_params.cache_salt)
        if target is None:
            return None
        self.counters["direct_start"] += 1
        return self.direct.call(target, submit)

    async def _follow(self, s: _Serving, role: str, stream) -> None:
        async for item in _accepted_within(stream, ACCEPT_TIMEOUT_S):
            if isinstance(item, Accepted):
                self._hold(s, role, item)
            elif (lost := retry_whole(item)) is not None:
                raise lost

    # ---- what comes back ----
    def _deliver(self, s: _Serving, rsp: RequestDelta) -> bool:
        """Post-processes one response into the result; True once the request is finished."""
        return s.sink.apply_response(s.record, rsp)

    def _hold(self, s: _Serving, role: str, accepted: Accepted) -> None:
        s.holders.hold(role, accepted, s.engine_id, s.result.aborted())
        if role == "decode" and self.direct is not None:
            self.direct.learn(accepted)

    async def _whole(self, s: _Serving) -> DisaggregatedParams:
        """What an engine serving the request whole needs of its images: fresh embedding handles (the encoder's
        cache makes a repeat cheap)."""
        return _with_images(await self._encode(s))

    async def _encode(self, s: _Serving) -> DisaggregatedParams:
        """The embedding handles of the request's images; an encoder replica lost during the call is replaced by
        another, a bounded number of times."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                return await self.roles.encode(s.result, s.images)
            except LOST as exc:
                last_error = _lost("encoder", exc)
                log.warning("request %d: %s (encoder call %d of %d)", s.result.request_id, last_error, attempt + 1,
                            MAX_ATTEMPTS)
        raise RequestError(f"the images of request {s.result.request_id} could not be encoded: {last_error} "
                           f"({MAX_ATTEMPTS} attempts)")



def _resume(s: _Serving, engine_id: int, record: DetokenizedGenerationResultBase) -> Resume | None:
    """The request's unfinished candidates as far as this owner has them; it goes on under a new engine id and
    record."""
    outs = [o for o in s.result.candidates if o.finish_reason is None]
    if not outs:
        return None
    s.engine_id, s.record = engine_id, record
    s.record.prime({o.index: list(o.token_ids) for o in s.result.candidates})
    return Resume(tuple(ResumedCandidate(o.index, tuple(o.token_ids), o.cumulative_logprob or 0.0) for o in outs))


def _submit(s: _Serving, params: DisaggregatedParams | None, resume: Resume | None = None,
            route: PostprocRoute | None = None) -> Submit:
    return Submit(s.engine_id, s.result.prompt_token_ids, s.result.sampling_params, params, resume, route)


def _with_images(mm: DisaggregatedParams | None, request_type: RequestType = "context_and_generation"
                 ) -> DisaggregatedParams:
    """A call's params: its request type, with the encoder's handles and hashes of the prompt's images (mm)."""
    mm = mm or DisaggregatedParams()
    return DisaggregatedParams(request_type, multimodal_embedding_handles=mm.multimodal_embedding_handles,
                               multimodal_hashes=mm.multimodal_hashes)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _accepted_within(stream: AsyncIterator, timeout: float) -> AsyncIterator:
    """The stream's items; NotAccepted if its first (Accepted) does not come within timeout."""
    it = stream.__aiter__()
    try:
        try:
            first = await asyncio.wait_for(it.__anext__(), timeout)
        except asyncio.TimeoutError:
            raise NotAccepted(f"no replica took the call within {timeout} s") from None
        except StopAsyncIteration:
            return
        yield first
        async for item in it:
            yield item
    finally:
        await it.aclose()  # an early exit ends the call now (Serve cancels it), not whenever it is collected


def _lost(role: str, exc: BaseException) -> str:
    """What happened, in words that name the role and never a pid, an actor id or an address."""
    if isinstance(exc, (PostprocLost, PostprocUnreachable)):
        return "its postproc worker was lost"
    if isinstance(exc, PromptInputsLost):
        return f"its {role} worker could not read the prompt's KV or its images' embeddings"
    if isinstance(exc, NotAccepted):
        return f"no {role} worker took it within {ACCEPT_TIMEOUT_S} s"
    return f"its {role} worker was lost"


def _cancelled(s: _Serving) -> RequestDelta:
    """The request's end when the owner stops it between calls: every unfinished candidate is cancelled."""
    deltas = tuple(TokenDelta(o.index, (), o.cumulative_logprob or 0.0, finish_reason="cancelled")
                   for o in s.result.candidates if o.finish_reason is None)
    return RequestDelta(s.result.request_id, deltas, finished=True)
