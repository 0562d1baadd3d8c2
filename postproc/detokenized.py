"""The post-processing record of one request: RequestDeltas (token ids) in, RequestDeltas with text out.

It runs wherever post-processing runs: in the embedded LLM's loop (no postproc workers) or inside a PostprocWorker.
"""

from __future__ import annotations

from dataclasses import replace

from postproc.detokenizer import CandidateText
from llmapi.outputs import RequestDelta, TokenDelta
from llmapi.sampling_params import SamplingParams


class DetokenizedGenerationResultBase:
    """Detokenizes each candidate incrementally and applies stop strings.

    handle() returns the delta for the owner and the candidates whose stop string matched (should_abort: the
    engine must stop them). Once finished, later responses for the request are ignored.
    """

    def __init__(self, request_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams, tokenizer,
                 streaming: bool = False):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.streaming = streaming
        p = sampling_params
        self._texts = [
            CandidateText(tokenizer, p.stop, p.include_stop_str_in_output, p.skip_special_tokens, prompt_token_ids)
            for _ in range(p.num_candidates)
        ]
        self._done = [False] * p.num_candidates
        self.finished = False

    def prime(self, tokens: dict[int, list[int]]) -> None:
        """Feeds candidates tokens without reporting them: their text was delivered elsewhere (the prefill side's
        first token; a lost worker's output), but an unfinished character or a stop string may continue into the
        next tokens. tokens: candidate index -> its token ids so far."""
        for index, ids in tokens.items():
            self._texts[index].add(list(ids))

    def handle(self, rsp: RequestDelta) -> tuple[RequestDelta | None, list[int]]:
        if self.finished:
            return None, []
        deltas, to_abort = [], []
        for d in rsp.deltas:
            if self._done[d.index]:
                continue
            delta = self._candidate(d)
            if delta.finish_reason is not None:
                self._done[d.index] = True
                if d.finish_reason is None:
                    to_abort.append(d.index)
            deltas.append(delta)
        self.finished = rsp.finished or all(self._done) or rsp.error is not None
        return replace(rsp, deltas=tuple(deltas), finished=self.finished), to_abort

    def _candidate(self, d: TokenDelta) -> TokenDelta:
        text = self._texts[d.index]
        diff, stop = text.add(d.token_ids)
        finish, stop_reason = d.finish_reason, d.stop_reason
        if stop is not None:
            finish, stop_reason = "stop", stop
        elif finish is not None:
            diff += text.finish()
        return replace(d, finish_reason=finish, stop_reason=stop_reason, text=diff)
