"""Engine-side request state. A request owns its state; the scheduler only moves it between queues."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from llmapi.disaggregated_params import RequestType
from llmapi.sampling_params import SamplingParams

if TYPE_CHECKING:  # types only: these modules need torch and nixl, a request does not
    import torch

    from engine.kv.kv_handle import KVHandle
    from engine.sampling.grammar import GrammarMatcher



class SeqStatus(Enum):
    WAITING = auto()
    WAITING_FOR_KV = auto()  # a remote read of the prompt's KV is in flight; the sequence holds its blocks
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class FirstToken:
    """A candidate's first token as the prefill side sampled it (a generation-only request starts from these)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float, int], ...] = ()  # (token, logprob, rank), when logprobs were asked for


@dataclass(frozen=True)
class MultimodalItem:
    """One image's place in the prompt: its content hash and the token positions its embeddings fill."""

    content_hash: tuple[int, ...]  # 8 int32
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


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
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV layer group (engine/kv/kv_cache.py)
    status: SeqStatus = SeqStatus.WAITING
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of the block tables entered in the prefix cache
    grammar: GrammarMatcher | None = None  # at this sequence's place, when the request has a grammar
    draft: list[int] = field(default_factory=list)  # speculated next tokens this step verifies (engine/spec/)

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

    @property
    def num_slots(self) -> int:
        """Seats in the running batch this sequence stands for: a request not yet forked brings all its candidates."""
        return 1 if self.request.forked else self.request.sampling_params.num_candidates


@dataclass(eq=False)
class EngineRequest:
    """A request as the engine sees it: the prompt, its parameters and its candidate sequences."""

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kind: RequestType = "context_and_generation"
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # True once every candidate has its own sequence
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> (vocab,) fp32 logits, if asked
    reported_queue_time: bool = False
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries from everyone else's
    mm_items: tuple[MultimodalItem, ...] = ()
    # Aligned with mm_items: each image's (length, hidden) embeddings, kept until the request ends (a preempted
    # request recomputes its prompt and splices them again). Empty on a generation-only request: it reads the KV.
    mm_embeddings: tuple[torch.Tensor, ...] = ()
    kv_source: KVHandle | None = None  # generation_only: the verified KV handle its prompt's KV is read from
    first_tokens: tuple[FirstToken, ...] = ()  # generation_only: each candidate's first token, from the prefill side
    carried_draft: tuple[int, ...] = ()  # generation_only: the prefill side's drafts after the first token
    echo_first_tokens: bool = True  # generation_only: emit the first tokens again (an owner that streamed them: no)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first admitted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def context_only(self) -> bool:
        return self.kind == "context_only"

    @property
    def wants_prompt_logits(self) -> bool:
        p = self.sampling_params
        return p.prompt_logprobs is not None or p.return_context_logits

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)

    @property
    def can_recompute(self) -> bool:
        """Whether this engine can compute the prompt itself: not if it has images but not their embeddings."""
        return not self.mm_items or bool(self.mm_embeddings)
