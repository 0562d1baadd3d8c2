"""Speculative decoding's drafts from a smaller model (vLLM's `method: draft_model`).

The draft checkpoint (same vocabulary) runs in this engine's process with a KV pool of its own. Each step, every
decoding sequence's draft twin (a Sequence sharing its token list, with the draft pool's block tables) first catches
up on the tokens the draft has not computed (the prompt on its first step; afterwards the tokens accepted since),
which yields the first draft token; then one forward per further draft token, all sequences batched. Draft tokens
are sampled as the target samples its tokens: greedy rows take the argmax, seeded rows draw with the uniform the
target draws with at that position ((seed, candidate, position)), so where the draft's distribution is close to the
target's the two draws agree and the draft is kept (the target's own draw decides, engine/spec/ngram.py's rule).
After verification the twin's progress is cut back to the tokens it computed that were kept.

Not drafted: requests with images (the draft model is text-only) or a grammar.

Hand-offs: on a context-only request (one candidate) the prefill engine's draft computes the prompt and the first
token and drafts the next k tokens, which travel in `draft_tokens`; the draft's KV of the prompt stays in the draft
pool, named by the same signed KV handle (engine/kv/kv_handle.py's DraftKV says why a pool of its own) and held under
the same lease. The decode engine's draft reads it into its own pool with the target's KV, if the two drafts are the
same checkpoint and layout, and the sequence's first step verifies the carried drafts; its twin then catches up on
the tokens after the prompt only. Any other case (no draft part, another draft, no room in the draft pool, the
target's blocks all in the decode side's prefix cache) falls back to computing the prompt in the first catch-up.
"""

from __future__ import annotations

import logging

import torch

from engine.core.request import Sequence
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import KVCache
from engine.kv.kv_handle import KVHandle, compatibility_problems
from engine.model.causal_lm import CausalLM
from engine.model.runner import ModelRunner
from engine.sampling.sampler import Sampler, SampleRow
from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Drafter

log = logging.getLogger(__name__)

class DraftModelDrafter(Drafter):
    """capacity_tokens: tokens the draft's pool holds (the engine's pool's); dtype, device: the engine's."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, vocab_size: int, block_size: int,
                 capacity_tokens: int, dtype: str | None, device: str, kernels=None):
        super().__init__(config, max_model_len)
        self.model = CausalLM.from_pretrained(config.model, dtype=dtype, device=device)
        if self.model.spec.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {self.model.spec.vocab_size} tokens, the model's "
                             f"{vocab_size}: a draft must share the tokenizer")
        layout = self.model.kv_layout(block_size)
        num_blocks = -(-capacity_tokens // block_size) * len(layout.groups)
        self.block_manager = BlockManager(num_blocks, block_size, False, layout.group_windows)
        self.runner = ModelRunner(self.model, KVCache(layout, num_blocks, device))
        self.sampler = Sampler(0, kernels)
        self.fingerprint = self.model.spec.fingerprint
        self._twins: dict[Sequence, Sequence] = {}
        self._refused: set[str] = set()  # prefill engines whose draft KV this one cannot use (said once each)
        self.num_prompt_tokens_computed = 0  # prompt positions the draft computed (none after a draft KV import)
        self.num_kv_imports = 0  # hand-offs whose prompt's draft KV was read, not computed

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    def propose(self, seqs: list[Sequence], budget: int) -> list[list[int]]:
        wants, out = {}, {}  # twin -> drafts to make; seq -> its drafts
        for seq in seqs:
            k = self.limit(seq, budget)
            out[seq] = self.carried(seq, k)  # the prefill side's drafts: verified first, nothing to compute
            if k and not out[seq] and (k := self._reserve(self._twin(seq), k)):
                wants[self._twins[seq]] = k
            budget -= len(out[seq]) or k
        if wants:
            self._draft(wants)
        for seq in seqs:
            twin = self._twins.get(seq)
            if twin in wants:
                out[seq], twin.draft = twin.draft, []
        return [out[seq] for seq in seqs]

    def first_drafts(self, seq: Sequence, first_token: int) -> list[int]:
        """The prefill side: the draft computes the prompt and the first token and drafts after it; its KV of the
        prompt is kept for lease_blocks() (the rest is dropped)."""
        k = self.limit(seq, self.config.num_speculative_tokens, appended=1)
        if not k:
            return []
        twin = self._twins[seq] = Sequence(seq.seq_id, seq.request, seq.index, seq.token_ids + [first_token])
        self.block_manager.admit(twin, self.block_manager.lookup([]))
        k = self._reserve(twin, k)
        if not k:
            self.release(seq)
            return []
        self._draft({twin: k})
        drafts, twin.draft = twin.draft, []
        twin.token_ids.pop()  # the first token's KV is not handed over: the decode side's catch-up computes it
        twin.num_computed_tokens = twin.num_tokens
        self.block_manager.trim(twin)
        return drafts

    def lease_blocks(self, seq: Sequence, num_tokens: int) -> tuple[list[int], list[int]] | None:
        twin = self._twins.get(seq)
        if twin is None or twin.num_computed_tokens < num_tokens:
            return None
        return self.block_manager.lease_blocks(twin, num_tokens)

    def import_tables(self, seq: Sequence, handle: KVHandle) -> list[list[int]] | None:
        if handle.draft is None or self.limit(seq, 1, appended=1) == 0:
            return None
        d = handle.draft
        problems = compatibility_problems(self.kv_cache.layout, self.fingerprint, d.layout, d.fingerprint)
        if problems:
            if d.agent not in self._refused:
                self._refused.add(d.agent)
                log.warning("the draft KV of engine %r differs from this engine's draft (%s): this draft computes "
                            "its hand-offs' prompts itself", handle.agent, "; ".join(problems))
            return None
        twin = self._twin(seq)
        if not self.block_manager.can_allocate(twin, handle.num_tokens):
            self.release(seq)
            return None
        self.block_manager.allocate(twin, handle.num_tokens)
        return twin.block_tables

    def imported(self, seq: Sequence) -> None:
        twin = self._twins.get(seq)
        if twin is not None and any(twin.block_tables):
            twin.num_computed_tokens = seq.num_prompt_tokens
            self.num_kv_imports += 1

    def release(self, seq: Sequence) -> None:
        twin = self._twins.pop(seq, None)
        if twin is not None:
            self.block_manager.free(twin)

    def limit(self, seq: Sequence, budget: int, appended: int = 0) -> int:
        return 0 if seq.request.mm_items else super().limit(seq, budget, appended)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "spec_draft_prompt_tokens": self.num_prompt_tokens_computed,
                "spec_draft_kv_imports": self.num_kv_imports}

    def _reserve(self, twin: Sequence, k: int) -> int:
        """Cuts the twin back to its kept tokens and gives it blocks for k drafts (fewer if the pool is short);
        returns how many it can draft."""
        twin.num_computed_tokens = min(twin.num_computed_tokens, twin.num_tokens - 1)
        self.block_manager.trim(twin)
        catch_up = twin.num_tokens - twin.num_computed_tokens
        while k and not self.block_manager.can_allocate(twin, catch_up + k - 1):
            k -= 1
        if k:
            self.block_manager.allocate(twin, catch_up + k - 1)
        return k

    def _twin(self, seq: Sequence) -> Sequence:
        twin = self._twins.get(seq)
        if twin is None:  # shares the token list: what seq appends, the twin sees
            twin = self._twins[seq] = Sequence(seq.seq_id, seq.request, seq.index, seq.token_ids)
            self.block_manager.admit(twin, self.block_manager.lookup([]))
        return twin

    @torch.inference_mode()
    def _draft(self, wants: dict[Sequence, int]) -> None:
        """The catch-up forward (first draft token), then one forward per further draft token, batched; wants:
        twin -> how many drafts."""
        active = list(wants)
        scheduled = [(t, t.num_tokens - t.num_computed_tokens) for t in active]
        self.num_prompt_tokens_computed += sum(max(0, min(t.num_computed_tokens + n, t.num_prompt_tokens)
                                                   - t.num_computed_tokens) for t, n in scheduled)
        while active:
            rows, at = [], 0
            for _, n in scheduled:
                at += n
                rows.append(at - 1)
            logits = self.runner.run(scheduled, rows)
            samples = self.sampler(logits, [self._row(t) for t in active])
            for (twin, n), sample in zip(scheduled, samples):
                twin.num_computed_tokens += n
                twin.draft.append(sample.token_id)
            active = [t for t in active if len(t.draft) < wants[t]]
            scheduled = [(t, 1) for t in active]  # the last draft token itself is never computed

    @staticmethod
    def _row(twin: Sequence) -> SampleRow:
        """The draft token at its position, sampled as the target will sample that position (a twin's tokens are
        its sequence's, the first token included)."""
        return SampleRow(twin.request.sampling_params, twin.index, twin.num_tokens + len(twin.draft),
                         twin.token_ids + twin.draft, twin.num_prompt_tokens)
