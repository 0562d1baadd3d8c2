"""ResultSink: where one request's post-processed output lands, whoever post-processed it and however it came.

Post-processing (detokenization, stop strings, the user hook) yields a RequestDelta for the request's result and the
candidates it ended that the engine does not know have ended (`should_abort`). Every place a request's output arrives
applies it the same way: the embedded LLM detokenizing on its engine thread, its postproc pool's lane, and the
cluster's request owner (its own record, or its lane on the postproc workers).
"""

from __future__ import annotations

from typing import Callable, Sequence

from llmapi.outputs import RequestDelta
from llmapi.result import GenerationResult
from postproc.detokenized import DetokenizedGenerationResultBase


class ResultSink:
    """stop: tells the engine that holds the request to stop these candidates (freeing their blocks); stopping a
    candidate or request that has already ended does nothing."""

    def __init__(self, result: GenerationResult, stop: Callable[[tuple[int, ...]], None]):
        self.result = result
        self._stop = stop

    def apply(self, delta: RequestDelta | None, should_abort: Sequence[int] = ()) -> None:
        if should_abort:
            self._stop(tuple(should_abort))
        if delta is not None:
            self.result.put(delta)

    def apply_response(self, record: DetokenizedGenerationResultBase, rsp: RequestDelta) -> bool:
        """Post-processes an engine response here (no postproc worker) and applies it; True once the request is
        finished."""
        delta, should_abort = record.handle(rsp)
        self.apply(delta, should_abort)
        return record.finished
