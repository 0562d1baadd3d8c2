"""Engine-side request state. A request owns its state; the scheduler only moves it between queues."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from llmapi.sampling_params import SamplingParams


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One candidate of a request: its tokens, its KV blocks and how many of its tokens are in the cache.

    Progress is a counter: the sequence is prefilled when num_computed_tokens reaches num_tokens - 1 and a new
    token was sampled; a sequence handed over from a prefill worker arrives with the counter already set.
    """

    seq_id: int
    request: "EngineRequest"
    index: int  # candidate index within the request
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class EngineRequest:
    """A request as the engine sees it: the prompt, its parameters and its candidate sequences."""

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # True once every candidate has its own sequence
    context_only: bool = False  # prefill role: stop after the first token, keep the blocks for the decode side
    prompt_logits: dict[int, object] = field(default_factory=dict)  # position -> (vocab,) fp32 logits, when asked for
    reported_queue_time: bool = False
    followers: list["Sequence"] = field(default_factory=list)  # candidates waiting for the first one's KV import

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        p = self.sampling_params
        return p.prompt_logprobs is not None or p.return_context_logits

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)
