"""Speculative decoding's drafts: n-gram prompt lookup (vLLM's `method: ngram`).

A running sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in its
own tokens (prompt and output); the tokens that followed a match are the draft (the latest match with enough tokens
after it, NgramIndex.propose). The target model then computes the sequence's next token and one position per draft
token in one forward; each position's token is sampled exactly as without speculation (same logits, same seeded
draw), and a draft token is kept while it equals the token sampled at its place (engine/core/output_processor.py),
so speculation changes how fast tokens come, never which: greedy or seeded, n-gram drafts being point guesses, this
is the acceptance rule that preserves the target distribution, at acceptance p(draft). Drafts depend on the sequence's tokens only, so a resumed or handed-over
sequence proposes the same.
"""

from __future__ import annotations

from engine.core.request import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Drafter


class NgramIndex:
    """Where each n-gram (n in [n_min, n_max]) of one sequence's tokens ends, kept up to date as tokens are
    appended: a lookup costs a few dict reads, not a scan of the sequence (a scan per sequence and step cost ~8% of
    a 16-sequence decode step of the bench model)."""

    def __init__(self, n_min: int, n_max: int):
        self.sizes = range(n_max, n_min - 1, -1)
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending
        self._indexed = 0  # tokens[:_indexed] are in _ends

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of tokens' last n tokens, for the largest n that
        has one: the latest occurrence with k tokens after it, else the earliest (the most after it); [] if none.
        tokens must extend those of earlier calls."""
        last = len(tokens) - 1
        for end in range(self._indexed, last):  # the last token's n-grams wait: they cannot have a follower yet
            for n in self.sizes:
                if end >= n - 1:
                    self._ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)
        self._indexed = max(self._indexed, last)
        if k < 1:
            return []
        for n in self.sizes:
            ends = self._ends.get(tuple(tokens[-n:])) if last >= n else None
            if ends:
                end = next((e for e in reversed(ends) if e + k <= last), ends[0])
                return tokens[end + 1:end + 1 + k]
        return []


def lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """NgramIndex.propose on a fresh index."""
    return NgramIndex(n_min, n_max).propose(tokens, k)


class NgramDrafter(Drafter):
    """Prompt lookup, from an NgramIndex per sequence."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        super().__init__(config, max_model_len)
        self._indexes: dict[Sequence, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], budget: int) -> list[list[int]]:
        out = []
        for seq in seqs:
            draft = self._one(seq, self.limit(seq, budget))
            budget -= len(draft)
            out.append(draft)
        return out

    def _one(self, seq: Sequence, k: int) -> list[int]:
        carried = self.carried(seq, k)
        if carried:
            return carried
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return index.propose(seq.token_ids, k)

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)

    def first_drafts(self, seq: Sequence, first_token: int) -> list[int]:
        """A context-only request's drafts after its first token, for the decode side's first step."""
        k = self.limit(seq, self.config.num_speculative_tokens, appended=1)
        index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return index.propose(seq.token_ids + [first_token], k)
