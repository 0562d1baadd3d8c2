"""Speculative decoding's drafts from a smaller model (vLLM's `method: draft_model`).

The draft checkpoint (same vocabulary) runs in this engine's process with a KV pool of its own. Each step, every
decoding sequence's draft twin (a Sequence sharing its token list, with the draft pool's block tables) first catches
up on the tokens the draft has not computed (the prompt on its first step; afterwards the tokens accepted since),
which yields the first draft token; then one forward per further draft token, all sequences batched. Draft tokens
are sampled as the target samples its tokens: greedy rows take the argmax, seeded rows draw with the uniform the
target draws with at that position ((seed, candidate, position)), so where the draft's distribution is close to the
target's the two draws agree and the draft is kept (the target's own draw decides, engine/spec/ngram.py's rule).
After verification the twin's progress is cut back to the tokens it computed that were kept.

Not drafted: requests with images (the draft model is text-only) or a grammar. A context-only request hands over no
drafts: the decode side's draft computes the prompt on the first step.
"""

from __future__ import annotations

import torch

from engine.core.request import Sequence
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.runner import ModelRunner
from engine.sampling.sampler import Sampler, SampleRow
from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Drafter


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
        self._twins: dict[Sequence, Sequence] = {}

    def propose(self, seqs: list[Sequence], budget: int) -> list[list[int]]:
        wants = {}
        for seq in seqs:
            k = self._reserve(seq, self.limit(seq, budget))
            if k:
                wants[seq] = k
                budget -= k
        if wants:
            self._draft(wants)
        out = []
        for seq in seqs:
            twin = self._twins.get(seq)
            out.append(twin.draft if twin is not None and seq in wants else [])
            if twin is not None:
                twin.draft = []
        return out

    def release(self, seq: Sequence) -> None:
        twin = self._twins.pop(seq, None)
        if twin is not None:
            self.block_manager.free(twin)

    def limit(self, seq: Sequence, budget: int) -> int:
        return 0 if seq.request.mm_items else super().limit(seq, budget)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Cuts seq's twin back to its kept tokens and gives it blocks for k drafts (fewer if the pool is short);
        returns how many it can draft."""
        if k == 0:
            return 0
        twin = self._twin(seq)
        twin.num_computed_tokens = min(twin.num_computed_tokens, seq.num_tokens - 1)
        self.block_manager.trim(twin)
        catch_up = seq.num_tokens - twin.num_computed_tokens
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
        """The catch-up forward (first draft token), then one forward per further draft token, batched."""
        active = list(wants)
        scheduled = [(self._twins[s], s.num_tokens - self._twins[s].num_computed_tokens) for s in active]
        while active:
            rows, at = [], 0
            for _, n in scheduled:
                at += n
                rows.append(at - 1)
            logits = self.runner.run(scheduled, rows)
            samples = self.sampler(logits, [self._row(s) for s in active])
            for (twin, n), sample in zip(scheduled, samples):
                twin.num_computed_tokens += n
                twin.draft.append(sample.token_id)
            active = [s for s in active if len(self._twins[s].draft) < wants[s]]
            scheduled = [(self._twins[s], 1) for s in active]  # the last draft token itself is never computed

    def _row(self, seq: Sequence) -> SampleRow:
        """The draft token at its position, sampled as the target will sample that position."""
        draft = self._twins[seq].draft
        return SampleRow(seq.request.sampling_params, seq.index, seq.num_tokens + len(draft),
                         seq.token_ids + draft, seq.num_prompt_tokens)
