"""Plain output types, and the one message that carries a request's progress: RequestDelta, from the engine to
post-processing (token ids, one TokenDelta per candidate per step) and from post-processing to the request's owner (the
same, with each TokenDelta's text filled in and stop strings applied). Nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmapi.disaggregated_params import DisaggregatedParams

FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error")


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token


# One position's logprobs: the chosen token and the top-k alternatives, token id -> Logprob.
TokenLogprobs = dict[int, Logprob]


class MetricNames(str, Enum):
    TTFT = "ttft"
    TPOT = "tpot"
    E2E = "e2e"
    REQUEST_QUEUE_TIME = "request_queue_time"
    PROMPT_TOKENS = "prompt_tokens"
    GENERATION_TOKENS = "generation_tokens"
    SPEC_DRAFT_TOKENS = "spec_draft_tokens"  # speculative decoding: drafts verified (only when there were any)
    SPEC_ACCEPTED_TOKENS = "spec_accepted_tokens"  # of those, kept


@dataclass
class CompletionOutput:
    """One candidate sequence of a request. The *_diff properties are what changed since the previous streaming step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _last_text_len: int = field(default=0, repr=False)
    _last_token_ids_len: int = field(default=0, repr=False)
    _last_logprobs_len: int = field(default=0, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list[TokenLogprobs]:
        return (self.logprobs or [])[self._last_logprobs_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def mark_seen(self) -> None:
        """Starts a new streaming step: the diffs are empty until more arrives."""
        self._last_text_len = len(self.text)
        self._last_token_ids_len = len(self.token_ids)
        self._last_logprobs_len = len(self.logprobs or [])


@dataclass(frozen=True)
class TokenDelta:
    """One candidate's progress in one engine step. text: those tokens' text once post-processed (detokenized, stop
    strings applied: finish_reason "stop" may then end it early); empty as the engine emits it."""

    index: int
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    num_draft_tokens: int = 0  # speculative drafts verified for this candidate in this step
    num_accepted_draft_tokens: int = 0  # of those, kept (each one token of token_ids)


@dataclass(frozen=True)
class Handoff:
    """How a context-only request ends when decoding goes on elsewhere: each candidate's first token and the signed
    handle (opaque_state) of the prompt's KV, held under a lease until a decode engine has read it; with speculation,
    the drafts of the token after the first (one candidate only), which the decode side verifies in its first step."""

    ctx_request_id: int
    first_gen_tokens: tuple[int, ...]
    opaque_state: bytes
    draft_tokens: tuple[int, ...] = ()

    def context_params(self) -> DisaggregatedParams:
        """What the context-only caller gets (the reference API's result.disaggregated_params)."""
        return DisaggregatedParams("context_only", list(self.first_gen_tokens), self.ctx_request_id, self.opaque_state,
                                   list(self.draft_tokens) or None)

    def generation_params(self) -> DisaggregatedParams:
        """What a decode engine takes to continue the request."""
        return DisaggregatedParams("generation_only", list(self.first_gen_tokens), self.ctx_request_id,
                                   self.opaque_state, list(self.draft_tokens) or None)


@dataclass(frozen=True)
class ResumedCandidate:
    """A candidate as far as it got elsewhere: its generated tokens and their cumulative logprob."""

    index: int
    token_ids: tuple[int, ...]
    cumulative_logprob: float = 0.0


@dataclass(frozen=True)
class Resume:
    """Continue a request from its candidates' tokens so far (its worker was lost). Draws depend only on (seed,
    candidate, position), so any engine continues a greedy or seeded candidate exactly."""

    candidates: tuple[ResumedCandidate, ...]

    def __post_init__(self) -> None:
        indices = [c.index for c in self.candidates]
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"Resume needs distinct candidates, got indices {indices}")


@dataclass(frozen=True)
class RequestDelta:
    """A request's progress in one step: what an engine emits (the `rsp` a post-processor receives) and, its deltas'
    text filled in, what post-processing hands the request's owner (the `res` of a post-processor's Output).

    finished: every candidate has finished. handoff: this engine is done with the request but it goes on (a
    context-only request's hand-off). Either way nothing more comes for the request from this engine (`final`).
    retry_whole: the error is one the request's owner recovers from by serving the request again whole elsewhere:
    what this engine was to read from another replica is gone (the prompt's KV, when it cannot compute the prompt
    itself because the images' embeddings were read on the prefill side only; or the images' embeddings).
    """

    request_id: int
    deltas: tuple[TokenDelta, ...]
    finished: bool
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first schedule, measured on the engine's clock
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    context_logits: Any = None  # torch.Tensor (num_prompt_tokens, vocab), first response only
    handoff: Handoff | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache, first response only
    retry_whole: bool = False

    @property
    def final(self) -> bool:
        return self.finished or self.handoff is not None or self.error is not None

    @property
    def disaggregated_params(self) -> DisaggregatedParams | None:
        """A context-only request's hand-off as its caller gets it (the reference API's disaggregated_params)."""
        return self.handoff.context_params() if self.handoff is not None else None
