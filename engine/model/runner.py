"""Model runner: turns a scheduled step into flat tensors and runs the model. It only reads sequences."""

from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata, SeqSlice
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.multimodal.processing import embeddings_in_span
from engine.core.request import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.arena.device

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """Computes the scheduled tokens' KV into the cache. Returns hidden states (T, hidden) and, per scheduled
        sequence, the flat index of its last new token."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        last_rows: list[int] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slices.append(SeqSlice(block_table=seq.block_table, start=start, num_new=n))
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(slices, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # (T,)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # (T,)
        hidden = self.model(input_ids, pos, meta, self.kv_cache, row_embeds=image_rows(scheduled, self.device))
        return hidden, last_rows

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(len(rows), vocab) fp32 logits of the given flat rows."""
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index)).float().cpu()


def image_rows(scheduled: list[tuple[Sequence, int]], device) -> tuple[torch.Tensor, torch.Tensor] | None:
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
    return torch.cat(rows).to(device), torch.cat(embeds).to(device)
