"""The user post-processing hook: one instance per postproc worker, called once per chunk of every request.

`post_processor_hook="my_module.MyHook"` names a `PostProcessorHook` subclass (or any class with the same `process`);
each worker imports and builds it once, with no arguments, so configuration belongs in the class or its module.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from llmapi.outputs import RequestDelta, TokenDelta
from llmapi.sampling_params import SamplingParams


@dataclass(frozen=True)
class Terminate:
    """Returned by a hook to end the request now.

    Every candidate the engine has not finished ends with finish_reason "stop" and stop_reason `reason`, and the
    owner is told to stop them in the engine (should_abort), which frees their KV blocks. `chunk` is what to emit
    before ending (the chunk given, or a modified one); None drops it.
    """

    reason: str
    chunk: RequestDelta | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"Terminate.reason must be a non-empty string, got {self.reason!r}")


class PostProcessorHook(ABC):
    """Sees each chunk (the RequestDelta of one request in one engine step) after detokenization and stop strings.

    A worker serves many requests with one instance, chunk by chunk in arrival order; per-request state may be kept
    keyed by `chunk.request_id` and dropped when `chunk.finished`. The hook runs on the worker's only thread: a slow
    hook slows every request of that worker.
    """

    @abstractmethod
    def process(self, chunk: RequestDelta, sampling_params: SamplingParams) -> RequestDelta | Terminate | None:
        """Decides what the owner gets for this chunk; must not mutate `chunk` (it is frozen; use dataclasses.replace).

        Returns the chunk to emit (the same or a modified one), None to suppress it, or Terminate(reason) to end
        the request. Suppressing a final chunk still delivers its finish reasons (with no text or tokens), so a
        request always ends for its owner. Raising fails this request with the error; the worker serves on.
        """


def load_hook(path: str | None) -> PostProcessorHook | None:
    """Builds the hook named by an import path `package.module.Class`; None means no hook."""
    if path is None:
        return None
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"post_processor_hook must be an import path 'module.Class', got {path!r}")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if cls is None or not callable(getattr(cls, "process", None)):
        raise ValueError(f"post_processor_hook {path!r} does not name a class with a process(chunk, params) method")
    return cls()


# ---- applying a hook's verdict (the worker's side) ----
@dataclass(eq=False)
class HookState:
    """What a worker remembers per request to apply verdicts: what the owner has been shown."""

    shown_done: set[int] = field(default_factory=set)  # candidates whose finish the owner has been sent
    logprob: dict[int, float] = field(default_factory=dict)  # last cumulative logprob, for deltas a Terminate adds

    def note(self, shown: RequestDelta | None) -> None:
        for d in shown.deltas if shown is not None else ():
            self.logprob[d.index] = d.cumulative_logprob
            if d.finish_reason is not None:
                self.shown_done.add(d.index)


def suppressed(res: RequestDelta) -> RequestDelta | None:
    """A suppressed chunk: its text and tokens go, its finish reasons and error stay so the owner still sees the end."""
    ends = tuple(replace(d, text="", token_ids=(), logprobs=None) for d in res.deltas if d.finish_reason is not None)
    if not ends and not res.finished and res.error is None:
        return None
    return replace(res, deltas=ends)


def terminated(res: RequestDelta, verdict: Terminate, num_candidates: int, state: HookState) -> RequestDelta:
    """The final chunk of a terminated request: every candidate not yet shown finished ends with the reason."""
    chunk = verdict.chunk if verdict.chunk is not None else replace(res, deltas=())
    state.note(chunk)
    given = {d.index: d for d in chunk.deltas}
    open_ = [given.pop(i, None) or TokenDelta(i, (), state.logprob.get(i, 0.0))
             for i in range(num_candidates) if i not in state.shown_done]
    ended = [replace(d, finish_reason="stop", stop_reason=verdict.reason) for d in open_]
    return replace(chunk, deltas=(*given.values(), *ended), finished=True)
