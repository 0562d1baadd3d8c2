"""Model runner: turns a scheduled step into a StepPlan (flat token lists and slices, and the rows whose logits the
step needs) and runs the model on it: the logits of those rows are what comes out. It only reads sequences. Under
tensor parallelism the plan goes to the other ranks first, which run the same forward on their shards
(engine/parallel/ranks.py), and each computes its slice of the vocabulary's logits; the sum of the slices lands on
every rank, and the sampling stays on this one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.attention import AttentionMetadata, SeqSlice
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.multimodal.processing import embeddings_in_span
from engine.core.request import Sequence
from engine.parallel.ranks import RankGroup


@dataclass(frozen=True)
class StepPlan:
    """One step's model input, all a rank needs to run it: what this rank sends the other tensor-parallel ranks, as
    vLLM v1's SchedulerOutput goes to its workers."""

    token_ids: list[int]  # (T,) the flat batch
    positions: list[int]  # (T,)
    slices: list[SeqSlice]
    row_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # image_rows', on the CPU
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) blocks other ranks copy first: forks since the last
    logit_rows: tuple[int, ...] = ()  # flat rows whose logits the step needs (sampling, prompt logprobs), in order


class ModelRunner:
    """ranks: the other tensor-parallel ranks (None: this rank is the whole model)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, ranks: RankGroup | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.arena.device
        self.ranks = ranks
        self._copies: list[tuple[int, int]] = []  # made here since the last plan; the other ranks repeat them

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]], logit_rows: list[int]) -> torch.Tensor:
        """Computes the scheduled tokens' KV into the cache (on every rank). Returns the fp32 logits (R, vocab), on
        the CPU, of the given rows of the step's flat batch (the scheduled sequences' new tokens, in order)."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend((seq.token_ids + seq.draft if seq.draft else seq.token_ids)[start : start + n])
            positions.extend(range(start, start + n))
            tables = tuple(seq.block_tables)
            if seq.draft:  # each verified position attends as a decode token would: the same logits, bit for bit
                slices.extend(SeqSlice(tables, start + i, 1) for i in range(n))
            else:
                slices.append(SeqSlice(block_tables=tables, start=start, num_new=n))
        plan = StepPlan(ids, positions, slices, image_rows(scheduled), tuple(self._copies), tuple(logit_rows))
        if self.ranks is None:
            return self.execute(plan)
        self._copies.clear()
        with self.ranks.guard():  # a rank that died is named, not a bare connection error
            self.ranks.send(plan)
            return self.execute(plan)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """The forward, then the logits of plan.logit_rows (a collective under tensor parallelism: every rank
        computes them)."""
        hidden = self.forward(plan)
        if not plan.logit_rows:
            return torch.empty((0, self.model.spec.vocab_size))
        index = torch.tensor(plan.logit_rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index)).float().cpu()

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The model on one step's plan: hidden states (T, hidden)."""
        meta = AttentionMetadata.build(plan.slices, self.block_size, self.device)
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=self.device)  # (T,)
        pos = torch.tensor(plan.positions, dtype=torch.long, device=self.device)  # (T,)
        embeds = plan.row_embeds and tuple(t.to(self.device) for t in plan.row_embeds)
        return self.model(input_ids, pos, meta, self.kv_cache, row_embeds=embeds)

    def replay(self, plan: StepPlan) -> None:
        """Another rank's step: the block copies made there since its last plan, then the forward."""
        for src, dst in plan.block_copies:
            self.kv_cache.copy_block(src, dst)
        self.execute(plan)

    def copy_block(self, src: int, dst: int) -> None:
        """Copies block src into dst (a fork's copy-on-write), here and, with the next plan, on the
        other ranks."""
        self.kv_cache.copy_block(src, dst)
        if self.ranks is not None:
            self._copies.append((src, dst))


def image_rows(scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The image embeddings this step's chunks cover, at their flat-batch rows: (rows (R,), embeddings (R, hidden)),
    or None when no chunk reaches into an image. A chunk covers positions [num_computed_tokens, + n): after a
    prefix-cache hit only the suffix is computed, so only its images' rows are spliced; decode tokens have none."""
    rows, embeds, first = [], [], 0
    for seq, n in scheduled:
        req, start = seq.request, seq.num_computed_tokens
        if req.mm_embeddings and start < req.num_prompt_tokens:
            span = embeddings_in_span(req.mm_items, req.mm_embeddings, start, n)
            if span is not None:
                rows.append(span[0] + first)
                embeds.append(span[1])
        first += n
    if not rows:
        return None
    return torch.cat(rows).cpu(), torch.cat(embeds).cpu()  # on the CPU in a plan: each rank moves them to its device
