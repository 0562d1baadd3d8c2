"""GenerationResult (the request owner's handle) and RequestOutput, with the reference API's semantics."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from typing import Callable

from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import CompletionOutput, MetricNames, RequestDelta, TokenDelta
from llmapi.sampling_params import SamplingParams

logger = logging.getLogger("raypd.trace")


class RequestError(RuntimeError):
    """The request failed; the message says where and why."""


class GenerationResult:
    """Owner-side state of one request, fed with RequestDeltas from any thread.

    result(timeout) is a total budget across steps and raises TimeoutError; iterating (sync or async) yields
    self once per applied step, with each output's *_diff covering that step.
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        streaming: bool = False,
        abort_fn: Callable[[int], None] | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
    ):
        if streaming and sampling_params.num_candidates > sampling_params.n:
            raise ValueError("SamplingParams.best_of > n cannot be streamed: the best candidates are known only at the end")
        self._request_id = request_id
        self._prompt = prompt
        self._prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.streaming = streaming
        self._abort_fn = abort_fn
        self._disaggregated_params = disaggregated_params
        # A context-only result is done once its hand-off arrives; a whole request goes on after it.
        self._context_only = disaggregated_params is not None and disaggregated_params.request_type == "context_only"
        self._num_cached_tokens: int | None = None
        self._drafts: dict[int, tuple[int, int]] = {}  # candidate -> speculative drafts verified, kept
        self._queue: queue.Queue[RequestDelta | BaseException] = queue.Queue()
        self._deferred: RequestDelta | BaseException | None = None  # a failure catch_up left for the next step
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # an async consumer waiting
        self._candidates = [CompletionOutput(i) for i in range(sampling_params.num_candidates)]
        self._done = False
        self._aborted = False
        self._error: str | None = None
        self._context_logits = None
        self.prompt_logprobs = None
        self._arrival = time.monotonic()
        self._token_times: dict[int, list[float]] = {}  # candidate -> [first token time, last token time]
        self._queue_time: float | None = None
        self.metrics: dict[int, dict[str, float]] = {}

    # ---- feeding (called by whoever delivers the request's progress) ----
    def put(self, item: RequestDelta | BaseException) -> None:
        """Hands one step (or a failure) to the result; thread-safe."""
        self._queue.put(item)
        waker = self._waker
        if waker is None:
            return
        loop, event = waker
        if asyncio._get_running_loop() is loop:
            event.set()  # on the waiter's own loop (a frontend's owner): no self-pipe write and second wakeup
        else:
            loop.call_soon_threadsafe(event.set)

    # ---- reference API properties ----
    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def prompt(self) -> str | None:
        return self._prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        n = self.sampling_params.n
        if not self._done or len(self._candidates) == n:
            return self._candidates
        best = sorted(self._candidates, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
        return best

    @property
    def candidates(self) -> list[CompletionOutput]:
        """Every candidate generated (best_of of them), before the n best are chosen."""
        return self._candidates

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def context_logits(self):
        return self._context_logits

    @property
    def disaggregated_params(self) -> DisaggregatedParams | None:
        return self._disaggregated_params

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the prefix cache instead of being computed (vLLM's name)."""
        return self._num_cached_tokens

    @property
    def metrics_dict(self) -> dict[str, float]:
        return self.metrics.get(0, {})

    # ---- waiting ----
    def result(self, timeout: float | None = None) -> "GenerationResult":
        """Waits for the whole request; `timeout` is a total budget, past it TimeoutError (the request runs on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            self._step(deadline)
        self._raise_if_failed()
        return self

    async def aresult(self, timeout: float | None = None) -> "GenerationResult":
        """result() for asyncio: waits on the event loop, holding no thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            await self._astep(deadline)
        self._raise_if_failed()
        return self

    def __iter__(self):
        return self

    def __next__(self) -> "GenerationResult":
        if self._done:
            raise StopIteration
        for c in self._candidates:
            c.mark_seen()
        self._step(None)
        return self

    def __aiter__(self):
        return self

    async def __anext__(self) -> "GenerationResult":
        if self._done:
            raise StopAsyncIteration
        for c in self._candidates:
            c.mark_seen()
        await self._astep(None)
        return self

    def catch_up(self) -> None:
        """Applies the steps already queued behind the current one, without waiting: the *_diff properties then cover
        them too. A streaming consumer that fell behind the engine sends one chunk for them all instead of one per
        step (vLLM merges its outputs the same way). A failure is not applied here: the next step raises it, after
        what came before it has been seen."""
        while not self._done and self._deferred is None:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, BaseException) or item.error is not None:
                self._deferred = item
                break
            self._apply(item)

    def abort(self) -> None:
        """Asks the engine to stop the request; it then finishes with finish_reason 'cancelled'."""
        if self._aborted or self._done:
            return
        self._aborted = True
        if self._abort_fn is not None:
            self._abort_fn(self._request_id)

    def aborted(self) -> bool:
        return self._aborted

    def _step(self, deadline: float | None) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"request {self._request_id} did not finish within the timeout")
        try:
            item = self._pop_nowait() if self._deferred is not None else self._queue.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError(f"request {self._request_id} did not finish within the timeout") from None
        self._handle(item)

    def _pop_nowait(self) -> RequestDelta | BaseException:
        item, self._deferred = self._deferred, None
        return item if item is not None else self._queue.get_nowait()

    def _handle(self, item: RequestDelta | BaseException) -> None:
        if isinstance(item, BaseException):
            self._fail(f"{type(item).__name__}: {item}")
        else:
            self._apply(item)
        self._raise_if_failed()

    async def _astep(self, deadline: float | None) -> None:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        self._waker = (loop, event)  # installed before looking at the queue, so no put() goes unnoticed
        try:
            while True:
                try:
                    item = self._pop_nowait()
                    break
                except queue.Empty:
                    pass
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"request {self._request_id} did not finish within the timeout")
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"request {self._request_id} did not finish within the timeout") from None
                event.clear()
        finally:
            self._waker = None
        self._handle(item)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RequestError(self._error)

    def _fail(self, message: str) -> None:
        self._error = message
        self._done = True
        for c in self._candidates:
            if c.finish_reason is None:
                c.finish_reason = "error"

    # ---- applying ----
    def _apply(self, delta: RequestDelta) -> None:
        now = time.monotonic()
        if delta.queue_time is not None:
            self._queue_time = delta.queue_time
        if delta.context_logits is not None:
            self._context_logits = delta.context_logits
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.disaggregated_params is not None:
            self._disaggregated_params = delta.disaggregated_params
        if delta.num_cached_tokens is not None:
            self._num_cached_tokens = delta.num_cached_tokens
        for d in delta.deltas:
            self._apply_candidate(d, now)
        if delta.error is not None:
            self._fail(delta.error)
        elif delta.finished or (self._context_only and delta.disaggregated_params is not None):
            self._done = True

    def _apply_candidate(self, d: TokenDelta, now: float) -> None:
        out = self._candidates[d.index]
        if d.token_ids:
            times = self._token_times.setdefault(d.index, [now, now])
            times[1] = now
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        out.cumulative_logprob = d.cumulative_logprob
        if d.logprobs is not None:
            out.logprobs = (out.logprobs or []) + list(d.logprobs)
        if d.num_draft_tokens:
            drafted, accepted = self._drafts.get(d.index, (0, 0))
            self._drafts[d.index] = (drafted + d.num_draft_tokens, accepted + d.num_accepted_draft_tokens)
        if d.finish_reason is not None and out.finish_reason is None:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
            self.record_stats(out, sequence_index=d.index)
            self.do_tracing(out, self.metrics.get(d.index))

    # ---- stats ----
    def record_stats(self, output: CompletionOutput, stats: dict[str, float] | None = None, sequence_index: int = 0) -> None:
        """Records one candidate's metrics when it finishes. PROMPT_TOKENS only for sequence_index 0."""
        first, last = self._token_times.get(sequence_index, [None, None])
        stats = dict(stats or {})
        end = time.monotonic()
        if first is not None:
            stats.setdefault(MetricNames.TTFT.value, first - self._arrival)
        n_gen = output.length
        if first is not None and n_gen > 1:
            stats.setdefault(MetricNames.TPOT.value, (last - first) / (n_gen - 1))
        stats.setdefault(MetricNames.E2E.value, end - self._arrival)
        if self._queue_time is not None:
            stats.setdefault(MetricNames.REQUEST_QUEUE_TIME.value, self._queue_time)
        stats[MetricNames.GENERATION_TOKENS.value] = float(n_gen)
        if sequence_index in self._drafts:
            drafted, accepted = self._drafts[sequence_index]
            stats[MetricNames.SPEC_DRAFT_TOKENS.value] = float(drafted)
            stats[MetricNames.SPEC_ACCEPTED_TOKENS.value] = float(accepted)
        if sequence_index == 0:
            stats[MetricNames.PROMPT_TOKENS.value] = float(len(self._prompt_token_ids))
        self.metrics[sequence_index] = stats

    def do_tracing(self, output: CompletionOutput, req_perf_metrics_dict: dict[str, float] | None = None) -> None:
        """Emits one trace record per finished candidate on the 'raypd.trace' logger (attach a handler to export)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request=%s candidate=%s finish=%s tokens=%s metrics=%s",
                self._request_id, output.index, output.finish_reason, output.length, req_perf_metrics_dict,
            )

    def clear_logprob_params(self) -> None:
        """Stops returning logprobs for the rest of the request (drops what was kept)."""
        self.sampling_params.logprobs = None
        self.sampling_params.prompt_logprobs = None
        for c in self._candidates:
            c.logprobs = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(request_id={self._request_id}, finished={self._done}, outputs={self.outputs!r})"


class RequestOutput(GenerationResult):
    """The output data of a completion request to the LLM (what generate / generate_async return)."""
