"""Drafter: what the scheduler asks of a speculation method (engine/spec/ngram.py, engine/spec/draft_model.py)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from engine.core.request import Sequence
from engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.kv.kv_handle import KVHandle


class Drafter(abc.ABC):
    """What the scheduler asks of a speculation method: drafts for the decoding sequences of a step (enabled(),
    propose()), the drafts a context-only request hands over (first_drafts()) with the KV the drafter computed for
    its prompt (lease_blocks()), that KV read on the other side (import_tables(), imported()), and counters.
    release(seq): seq left the running batch (finished, preempted, or its hand-off's lease ended); whatever the
    drafter holds for it is freed."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafted = 0  # draft tokens the target model verified
        self.num_accepted = 0  # of those, accepted
        self.num_verify_steps = 0  # sequences' steps that verified at least one draft
        self.num_carried = 0  # of the drafted, those the prefill side proposed (verified on a hand-off's first step)

    def enabled(self, batch_size: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or batch_size <= limit

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], budget: int) -> list[list[int]]:
        """Each sequence's drafts for this step (in order; together at most budget tokens)."""

    def first_drafts(self, seq: Sequence, first_token: int) -> list[int]:
        return []

    def carried(self, seq: Sequence, k: int) -> list[int]:
        """The prefill side's drafts after the first token, on a generation-only sequence's first step."""
        carried = list(seq.request.carried_draft[:k]) if seq.num_output_tokens == 1 else []
        self.num_carried += len(carried)
        return carried

    def lease_blocks(self, seq: Sequence, num_tokens: int) -> tuple[list[int], list[int]] | None:
        """(block ids, group starts) of the drafter's own KV of seq's first num_tokens tokens, after first_drafts:
        held under the hand-off's lease until release(seq). None: the drafter has no such KV."""
        return None

    def import_tables(self, seq: Sequence, handle: KVHandle) -> list[list[int]] | None:
        """The drafter's block tables for seq, allocated to receive the handle's draft KV of the prompt; None if it
        cannot use it (no draft part, another draft, no room): it then computes the prompt itself. Mutates the
        drafter's pool."""
        return None

    def imported(self, seq: Sequence) -> None:
        """The read of import_tables()'s blocks succeeded: the prompt's draft KV is in place."""

    def release(self, seq: Sequence) -> None:
        pass

    def limit(self, seq: Sequence, budget: int, appended: int = 0) -> int:
        """How many drafts seq may take (appended: tokens it has beyond seq.token_ids, e.g. a first token not yet
        appended): none where speculation does not apply (a grammar must see every token before the next is
        masked), and no more than its max_tokens and the model's length leave after the next token."""
        if seq.grammar is not None:
            return 0
        params = seq.request.sampling_params
        outputs, tokens = seq.num_output_tokens + appended, seq.num_tokens + appended
        room = min(params.max_tokens - outputs, self.max_model_len - tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, budget, room))

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_verify_steps += 1

    def stats(self) -> dict[str, float]:
        return {"spec_draft_tokens": self.num_drafted, "spec_accepted_tokens": self.num_accepted,
                "spec_verify_steps": self.num_verify_steps, "spec_carried_draft_tokens": self.num_carried}
