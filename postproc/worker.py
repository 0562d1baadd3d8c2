"""PostprocWorker: token ids in (per-step batches from engines), text out (per-step batches to each owner's lane).

Wire protocol, over the signed pipes of postproc.pipes:
- engine -> worker `client_id % N`: one message per step, a list of `PostprocWorker.Input` (or `Shutdown()`).
  A request's first Input carries its parameters (sampling_params, postproc_params, streaming); a later one may be
  sent as its bare RequestDelta, which saves a wrapper per token on the wire.
- worker -> frontend lane `postproc_params.lane`: one message per step per lane, a list of `PostprocWorker.Output`
  as plain tuples (`Output._make` restores them; routing.Lane does): a NamedTuple pickles through a Python call.
  `Output.should_abort` lists the candidates the engine must stop (stop string, hook): the owner forwards it.
Records live per client_id from the first Input to the final Output; a later Input for an ended request is ignored.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from transformers import AutoTokenizer

from postproc.detokenized import DetokenizedGenerationResultBase
from llmapi.outputs import RequestDelta
from llmapi.sampling_params import SamplingParams
from postproc.hooks import HookState, Terminate, load_hook, suppressed, terminated
from postproc.pipes import PullPipe, PushPipe
from protocol import PipeAddr

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how soon start() notices close()
_PUSH_TIMEOUT_S = 5.0  # a lane whose frontend is gone must not stall the other lanes for long


@dataclass(frozen=True)
class PostprocParams:
    """What only post-processing needs of a request; sent on its first Input."""

    lane: int = 0  # index into the worker's push_pipe_addrs: the lane of the frontend that owns the request
    prompt_token_ids: tuple[int, ...] = ()  # context for non-byte-level detokenizers (SentencePiece)
    resumed: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (candidate, tokens so far) of a resumed request

    def __post_init__(self) -> None:
        if not isinstance(self.lane, int) or self.lane < 0:
            raise ValueError(f"PostprocParams.lane must be an integer >= 0, got {self.lane!r}")


@dataclass(frozen=True)
class Shutdown:
    """Sent on a worker's pull pipe: start() returns after the messages queued before it."""


@dataclass(eq=False)
class _Request:
    """The worker's state of one request."""

    record: Any
    params: SamplingParams
    lane: int
    engine_done: set[int] = field(default_factory=set)  # candidates the engine finished itself: nothing to stop
    hook_state: HookState = field(default_factory=HookState)
    num_tokens: int = 0


class PostprocWorker:
    """Detokenizes, applies stop strings and the user hook, and routes each output to its owner's lane.

    The pull pipe is bound at construction (`pull_pipe_addr` has the real port); `start()` runs the loop in the
    calling thread until a `Shutdown` message arrives or `close()` is called, and owns the pipes from then on.
    """

    class Input(NamedTuple):
        rsp: RequestDelta
        sampling_params: SamplingParams | None = None  # set on a request's first Input only
        postproc_params: PostprocParams | None = None
        disaggregated_params: Any = None
        streaming: bool | None = None

    class Output(NamedTuple):
        client_id: int
        res: RequestDelta | None
        is_final: bool
        metrics: dict[str, float] | None
        request_perf_metrics: Any
        disaggregated_params: Any
        should_abort: tuple[int, ...]  # candidates the engine must stop; empty (falsy) when none
        finish_reason: str | None  # "error" on failure, else the first finish reason in res, else None
        num_generated_tokens: int | None  # tokens the engine generated for the request so far, all candidates

    def __init__(
        self,
        pull_pipe_addr: PipeAddr,
        push_pipe_addrs: list[PipeAddr],
        tokenizer_dir: str,
        record_creator: Callable[["PostprocWorker.Input", Any], Any] | None = None,
        post_processor_hook: str | None = None,
    ):
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self._record_creator = record_creator or PostprocWorker.default_record_creator
        self._hook_path = post_processor_hook
        self._hook = load_hook(post_processor_hook)
        self._lane_addrs: list[PipeAddr] = []
        self._lane_lock = threading.Lock()
        for addr in push_pipe_addrs:
            self.add_lane(addr)
        self._pushes: list[PushPipe] = []
        self._requests: dict[int, _Request] = {}
        self._closed = threading.Event()
        self._pull = PullPipe(pull_pipe_addr)  # last: nothing after it can fail and leak the bound socket

    @staticmethod
    def default_record_creator(inp: "PostprocWorker.Input", tokenizer) -> DetokenizedGenerationResultBase:
        prompt = inp.postproc_params.prompt_token_ids if inp.postproc_params else ()
        record = DetokenizedGenerationResultBase(
            inp.rsp.request_id, list(prompt), inp.sampling_params, tokenizer, bool(inp.streaming)
        )
        dp = inp.disaggregated_params
        if dp is not None and dp.request_type == "generation_only" and dp.first_gen_tokens:
            # The owner streamed the first tokens from the prefill side; they still shape the text that follows.
            record.prime({k: [t] for k, t in enumerate(dp.first_gen_tokens)})
        if inp.postproc_params and inp.postproc_params.resumed:
            record.prime({k: list(ids) for k, ids in inp.postproc_params.resumed})  # the owner has this text
        return record

    @property
    def pull_pipe_addr(self) -> PipeAddr:
        return self._pull.addr

    @property
    def dropped(self) -> int:
        """Messages dropped unread by the pull pipe (bad, foreign or missing signature)."""
        return self._pull.dropped

    def add_lane(self, addr: PipeAddr) -> int:
        """Registers a frontend's lane (thread-safe, idempotent per address); returns its index for PostprocParams.lane.

        Batches that arrive after this returns can route to the lane: the loop connects new lanes before each batch.
        """
        addr = tuple(addr)  # a list after some transports: the same lane either way
        with self._lane_lock:
            if addr in self._lane_addrs:
                return self._lane_addrs.index(addr)
            self._lane_addrs.append(addr)
            return len(self._lane_addrs) - 1

    def close(self) -> None:
        """Makes start() return within ~0.1 s; thread-safe."""
        self._closed.set()

    def start(self) -> None:
        """Runs the loop in the current thread until a Shutdown message or close()."""
        try:
            while not self._closed.is_set():
                try:
                    msg = self._pull.get(timeout=_POLL_S)
                except TimeoutError:
                    continue
                if isinstance(msg, Shutdown):
                    break
                self._connect_new_lanes()
                self._push(self.process(msg if isinstance(msg, list) else [msg]))
        finally:
            self._pull.close()
            for push in self._pushes:
                push.close()

    # ---- one batch ----
    def process(self, inputs: list) -> dict[int, list["PostprocWorker.Output"]]:
        """Handles one step's Inputs (or bare RequestDeltas); returns the Outputs by lane. Public so benchmarks
        can drive it without pipes."""
        by_lane: dict[int, list[PostprocWorker.Output]] = {}
        for item in inputs:
            rsp = item if type(item) is RequestDelta else item.rsp
            req = self._requests.get(rsp.request_id) or self._open(item)
            if req is None:
                continue
            out = self._handle(req, rsp)
            if out is not None:
                by_lane.setdefault(req.lane, []).append(out)
        return by_lane

    def _open(self, inp: "PostprocWorker.Input | RequestDelta") -> _Request | None:
        if type(inp) is RequestDelta or inp.sampling_params is None:
            return None  # a late response for a request that already ended here (e.g. after a stop string)
        lane = inp.postproc_params.lane if inp.postproc_params else 0
        if lane >= len(self._lane_addrs):
            logger.error("request %s names lane %d, only %d registered: dropped", inp.rsp.request_id, lane,
                         len(self._lane_addrs))
            return None
        try:
            record = self._record_creator(inp, self._tokenizer)
        except Exception as exc:  # fails the request closed at its first handle(), like any post-processing error
            record = _FailedRecord(exc)
        req = self._requests[inp.rsp.request_id] = _Request(record, inp.sampling_params, lane)
        return req

    def _handle(self, req: _Request, rsp: RequestDelta) -> "PostprocWorker.Output | None":
        ended = False
        for d in rsp.deltas:
            req.num_tokens += len(d.token_ids)
            if d.finish_reason is not None:
                req.engine_done.add(d.index)
                ended = True
        try:
            res, to_abort = req.record.handle(rsp)
        except Exception as exc:  # fail closed: this request ends with the error, the worker serves the others
            return self._fail(req, rsp.request_id, "post-processing", exc)
        if self._hook is not None and res is not None:
            try:
                res, to_abort = self._run_hook(req, res, to_abort)
            except Exception as exc:
                return self._fail(req, rsp.request_id, f"post_processor_hook {self._hook_path!r}", exc)
        if res is None and not to_abort:
            return None
        return self._output(req, rsp.request_id, res, to_abort, ended, rsp.final)

    def _output(self, req: _Request, request_id: int, res: RequestDelta | None, to_abort, ended: bool,
                engine_done: bool = False):
        # The engine may be done without the request being so: a context-only request's hand-off.
        final = engine_done or (res is not None and res.finished)
        if final:
            del self._requests[request_id]
        finish = _finish_reason(res) if final or ended or to_abort else None  # most chunks finish nothing
        return self.Output(request_id, res, final, None, None, res.disaggregated_params if res else None,
                           tuple(to_abort), finish, req.num_tokens)

    def _fail(self, req: _Request, request_id: int, where: str, exc: Exception) -> "PostprocWorker.Output":
        """Ends the request with the error and asks the engine to stop whatever it still generates for it."""
        logger.warning("request %s failed in %s: %r", request_id, where, exc)
        res = RequestDelta(request_id, (), finished=True, error=f"{where} raised {type(exc).__name__}: {exc}")
        return self._output(req, request_id, res, self._unfinished(req), True)

    # ---- the user hook ----
    def _run_hook(self, req: _Request, res: RequestDelta, to_abort: list[int]) -> tuple[RequestDelta | None, list[int]]:
        verdict = self._hook.process(res, req.params)
        if isinstance(verdict, Terminate):
            return terminated(res, verdict, req.params.num_candidates, req.hook_state), self._unfinished(req)
        if verdict is not None and not isinstance(verdict, RequestDelta):
            raise TypeError(f"process() returned {type(verdict).__name__}: expected RequestDelta, Terminate or None")
        shown = verdict if verdict is not None else suppressed(res)
        req.hook_state.note(shown)
        return shown, to_abort

    def _unfinished(self, req: _Request) -> list[int]:
        return [i for i in range(req.params.num_candidates) if i not in req.engine_done]

    # ---- pipes ----
    def _connect_new_lanes(self) -> None:
        while len(self._pushes) < len(self._lane_addrs):
            self._pushes.append(PushPipe(self._lane_addrs[len(self._pushes)]))

    def _push(self, by_lane: dict[int, list["PostprocWorker.Output"]]) -> None:
        for lane, outputs in by_lane.items():
            try:
                self._pushes[lane].put([tuple(out) for out in outputs], timeout=_PUSH_TIMEOUT_S)
            except TimeoutError:
                logger.error("lane %d (%s) takes no outputs: %d dropped", lane, self._lane_addrs[lane][0], len(outputs))


class _FailedRecord:
    """Stands in for a record the record_creator could not make."""

    def __init__(self, exc: Exception):
        self.exc = exc

    def handle(self, rsp: RequestDelta):
        raise self.exc


def _finish_reason(res: RequestDelta | None) -> str | None:
    if res is None:
        return None
    if res.error is not None:
        return "error"
    return next((d.finish_reason for d in res.deltas if d.finish_reason is not None), None)
