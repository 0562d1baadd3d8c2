"""Paged attention over the block-major KV cache: the torch reference path, and the metadata both paths share.

One step's tokens are a flat batch: every sequence's new tokens, concatenated. AttentionMetadata turns the step's
SeqSlices into index and mask tensors once; every layer then reuses them. Here, decode tokens (one new token per
sequence) are attended together in padded SDPA calls over a gathered copy of their KV, one call per bucket of
similar context lengths; prefill chunks one call each, since their query counts differ. The C++ path
(engine/model/kernels.py) attends all decode tokens in one call reading the cache in place, and shares the prefill code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step."""

    block_tables: tuple[Sequence[int], ...]  # per KV layer group: blocks covering [0, start + num_new); < 0: released
    start: int  # tokens of this sequence already in the KV cache before this step
    num_new: int  # tokens of this sequence in this step's flat batch

    def __post_init__(self):
        if self.start < 0 or self.num_new < 1:
            raise ValueError(f"SeqSlice needs start >= 0, num_new >= 1; got start={self.start}, num_new={self.num_new}")


@dataclass(frozen=True)
class _DecodePlan:
    rows: torch.Tensor  # (D,) flat-batch rows of the decode tokens
    blocks: torch.Tensor  # (D, max_blocks) block tables, padded with block 0 (masked out)
    query_pos: torch.Tensor  # (D,) absolute position of each decode token


@dataclass(frozen=True)
class DecodeBatch:
    """Every decode token of a step, for a kernel that reads the paged cache in place (no buckets, no padding read)."""

    rows: torch.Tensor  # (D,) int64 flat-batch rows of the decode tokens
    tables: torch.Tensor  # (D, max_blocks) int32 block tables, padded with block 0 (never read)
    context_lens: torch.Tensor  # (D,) int64 keys each token attends: its position + 1


@dataclass(frozen=True)
class _PrefillPlan:
    row: int  # first flat-batch row of the chunk
    start: int
    num_new: int
    blocks: torch.Tensor | None  # (ceil((start + num_new) / block_size),); None when start == 0: attend fresh k/v
    table: torch.Tensor  # the context's blocks, int32 (what the C++ kernel reads, whatever the start)


class AttentionMetadata:
    """Index and mask tensors of one step, built once and shared by all layers.

    What only one path reads (the reference path's decode buckets, the kernels' decode batch) is built on first use.
    Masks that depend on the sliding window are built on first use per distinct window and kept here, so a model whose
    layers alternate windows builds each mask once per step. A model with several KV layer groups gets one metadata
    per group (`group(g)`): the same positions over that group's block tables.
    """

    def __init__(self, num_tokens, write_blocks, write_offsets, tables, starts, starts_list, first_row, decode_index,
                 prefills, block_size, positions=None, seq_of_token=None):
        self.num_tokens = num_tokens
        self.device = write_blocks.device
        self.write_blocks = write_blocks  # (T,) block of each new token
        self.write_offsets = write_offsets  # (T,) slot inside that block
        self._tables = tables  # (S, max_blocks) padded block tables
        self._starts = starts  # (S,) tokens already cached per slice
        self._starts_list = starts_list  # the same, as Python ints
        self._first_row = first_row  # (S,) flat row of each slice's first new token
        self._decode_index = decode_index  # slices with one new token, in flat-batch order
        self.prefills: list[_PrefillPlan] = prefills
        self.block_size = block_size
        self._positions = positions  # (T,) each token's position in its sequence
        self._seq_of_token = seq_of_token  # (T,) its slice
        self._masks: dict[tuple, tuple] = {}
        self._groups = [self]

    def group(self, g: int) -> AttentionMetadata:
        """The metadata of KV layer group g (engine/kv/kv_cache.py)."""
        return self._groups[g]

    @classmethod
    def build(cls, slices: list[SeqSlice], block_size: int, device) -> AttentionMetadata:
        """Slices with num_new == 1 go to the batched decode call, whatever their start; the rest are prefill chunks.
        Returns group 0's metadata; the others' through group()."""
        if not slices:
            raise ValueError("AttentionMetadata.build needs at least one SeqSlice")
        metas = [cls._build_group(slices, g, block_size, device) for g in range(len(slices[0].block_tables))]
        for meta in metas:
            meta._groups = metas
        return metas[0]

    @classmethod
    def _build_group(cls, slices: list[SeqSlice], group: int, block_size: int, device) -> AttentionMetadata:
        tables = _padded_tables(slices, group, block_size, device)  # (S, max_blocks)
        starts_list = [s.start for s in slices]
        counts_list = [s.num_new for s in slices]
        first_rows, rows = [], 0
        for n in counts_list:
            first_rows.append(rows)
            rows += n
        starts = torch.tensor(starts_list, dtype=torch.long, device=device)  # (S,)
        first_row = torch.tensor(first_rows, dtype=torch.long, device=device)  # (S,)
        if rows == len(slices):  # decode only: one token per slice, at position start
            pos, seq_of_token = starts, torch.arange(len(slices), device=device)  # (T,), (T,)
        else:
            counts = torch.tensor(counts_list, dtype=torch.long, device=device)  # (S,)
            seq_of_token = torch.repeat_interleave(torch.arange(len(slices), device=device), counts)  # (T,)
            pos = torch.arange(rows, device=device) - first_row[seq_of_token] + starts[seq_of_token]  # (T,)
        write_blocks = tables[seq_of_token, pos // block_size]  # (T,)
        decode_index = [i for i, n in enumerate(counts_list) if n == 1]
        prefills = _prefill_plans(slices, tables, first_rows, block_size)
        return cls(rows, write_blocks, pos % block_size, tables, starts, starts_list, first_row, decode_index,
                   prefills, block_size, pos, seq_of_token)

    @property
    def num_decode(self) -> int:
        return len(self._decode_index)

    @functools.cached_property
    def decode(self) -> list[_DecodePlan]:
        """The reference path's decode buckets: sequences of similar context lengths, padded to the longest."""
        return _decode_plans(self._decode_index, self._tables, self._first_row, self._starts, self._starts_list,
                             self.block_size)

    @functools.cached_property
    def decode_batch(self) -> DecodeBatch:
        idx = torch.tensor(self._decode_index, dtype=torch.long, device=self.device)  # (D,)
        starts = self._starts[idx]
        width = _blocks_needed(max(self._starts_list[i] for i in self._decode_index) + 1, self.block_size)
        tables = self._tables[idx, :width].to(torch.int32).contiguous()  # (D, width)
        return DecodeBatch(rows=self._first_row[idx], tables=tables, context_lens=starts + 1)

    @functools.cached_property
    def query_batch(self) -> DecodeBatch:
        """Every token of the step as a query of its own over its sequence's cache (prefill chunks' tokens too): what
        a batch-invariant step attends with, each query the same way whatever the batch or chunk around it."""
        return DecodeBatch(rows=torch.arange(self.num_tokens, device=self.device),
                           tables=self._tables[self._seq_of_token].to(torch.int32).contiguous(),
                           context_lens=self._positions + 1)

    def masks(self, window: int | None, dtype: torch.dtype) -> tuple[list, list]:
        """(one mask (D, 1, 1, L) or None per decode bucket, one mask (1, 1, n, L) or None per prefill), additive
        (0 or -inf) in the query dtype: SDPA would otherwise convert a boolean mask in every layer."""
        key = ("decode", window, dtype)
        if key not in self._masks:
            self._masks[key] = [_additive(_decode_mask(p, self.block_size, window), dtype) for p in self.decode]
        return self._masks[key], self.prefill_masks(window, dtype)

    def causal_mask(self, n: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The additive (1, 1, n, n) mask of a chunk of n tokens starting its sequence, built once per step."""
        key = ("causal", n, window, dtype)
        if key not in self._masks:
            positions = torch.arange(n, device=self.device)
            self._masks[key] = _additive(_visible(positions[:, None], positions, window), dtype)[None, None]
        return self._masks[key]

    def prefill_masks(self, window: int | None, dtype: torch.dtype) -> list:
        key = ("prefill", window, dtype)
        if key not in self._masks:
            self._masks[key] = [_additive(_prefill_mask(p, window, self.device), dtype) for p in self.prefills]
        return self._masks[key]


def _blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _padded_tables(slices: list[SeqSlice], group: int, block_size: int, device) -> torch.Tensor:
    rows = []
    for s in slices:
        needed = _blocks_needed(s.start + s.num_new, block_size)
        table = s.block_tables[group]
        if len(table) < needed:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s.start + s.num_new} tokens")
        rows.append(list(table[:needed]))
    width = max(len(r) for r in rows)
    # Padding, and a window group's released entries, point at block 0: a valid index whose keys the masks never let
    # through (and the kernels never read: they start at the window).
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)  # (S, width)
    return tables.clamp_(min=0)


# A decode bucket holds sequences needing at least this fraction of its longest one's blocks: padding every sequence
# to the batch's longest context would copy (and attend over) mostly padding when lengths spread widely.
_BUCKET_FILL = 0.8


def _decode_plans(decode_index, tables, first_row, starts, starts_list, block_size) -> list[_DecodePlan]:
    width = {i: _blocks_needed(starts_list[i] + 1, block_size) for i in decode_index}
    buckets: list[list[int]] = []
    for i in sorted(width, key=width.get, reverse=True):
        if not buckets or width[i] < _BUCKET_FILL * width[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(i)
    plans = []
    for bucket in buckets:
        longest = width[bucket[0]]
        # in flat-batch order, so that a step of decode tokens alone, in one bucket, needs no scatter of the output
        idx = torch.tensor(sorted(bucket), dtype=torch.long, device=tables.device)  # (D,)
        plans.append(_DecodePlan(rows=first_row[idx], blocks=tables[idx, :longest], query_pos=starts[idx]))
    return plans


def _prefill_plans(slices, tables, first_rows: list[int], block_size) -> list[_PrefillPlan]:
    plans = []
    for i, s in enumerate(slices):
        if s.num_new == 1:
            continue
        table = tables[i, : _blocks_needed(s.start + s.num_new, block_size)]
        plans.append(_PrefillPlan(first_rows[i], s.start, s.num_new, table if s.start > 0 else None,
                                  table.to(torch.int32)))
    return plans


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (+ sliding window: q - W < k <= q) visibility, broadcast over query_pos (..., 1) and key_pos (L,)."""
    seen = key_pos <= query_pos
    if window is not None:
        seen &= key_pos > query_pos - window
    return seen


def _decode_mask(plan: _DecodePlan, block_size: int, window: int | None) -> torch.Tensor | None:
    key_pos = torch.arange(plan.blocks.shape[1] * block_size, device=plan.blocks.device)  # (L,)
    mask = _visible(plan.query_pos[:, None], key_pos, window)  # (D, L)
    return None if bool(mask.all()) else mask[:, None, None, :]  # (D, 1, 1, L)


def _prefill_mask(plan: _PrefillPlan, window: int | None, device) -> torch.Tensor | None:
    context = plan.start + plan.num_new
    if plan.start == 0 and (window is None or window >= context):
        return None  # plain causal: SDPA's is_causal does it without a mask
    query_pos = torch.arange(plan.start, context, device=device)[:, None]  # (n, 1)
    return _visible(query_pos, torch.arange(context, device=device), window)[None, None]  # (1, 1, n, L)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None):
    """Writes k, v (T, kv_heads, head_dim) into the cache views, returns attention output (T, heads, head_dim).

    k_cache / v_cache: one layer's (num_blocks, block_size, kv_heads, head_dim) views of the arena.
    """
    k_cache[meta.write_blocks, meta.write_offsets] = k
    v_cache[meta.write_blocks, meta.write_offsets] = v
    decode_masks, prefill_masks = meta.masks(window, q.dtype)
    if len(meta.decode) == 1 and not meta.prefills:
        plan = meta.decode[0]
        return _decode_attention(q[plan.rows], k_cache, v_cache, plan, decode_masks[0], scale)
    out = torch.empty_like(q)  # (T, heads, head_dim)
    for plan, mask in zip(meta.decode, decode_masks):
        out[plan.rows] = _decode_attention(q[plan.rows], k_cache, v_cache, plan, mask, scale)
    for plan, mask in zip(meta.prefills, prefill_masks):
        rows = slice(plan.row, plan.row + plan.num_new)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, plan, mask, scale)
    return out


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache (num_blocks, block_size, kv_heads, head_dim) view, blocks (...,) -> (..., block_size, kv_heads, head_dim).

    A block is one contiguous span inside the strided view, so index_select on (num_blocks, span) copies whole spans;
    advanced indexing on the 4-d view goes element by element (~5x slower).
    """
    return cache.flatten(1).index_select(0, blocks.flatten()).view(*blocks.shape, *cache.shape[1:])


def _decode_context(k_cache, v_cache, plan: _DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode bucket's keys and values, each (D, kv_heads, L, head_dim), gathered from the cache."""
    keys = gather_blocks(k_cache, plan.blocks).flatten(1, 2).transpose(1, 2)
    return keys, gather_blocks(v_cache, plan.blocks).flatten(1, 2).transpose(1, 2)


def _chunk_context(k, v, k_cache, v_cache, plan: _PrefillPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's keys and values, each (context, kv_heads, head_dim): its own k, v when it starts its sequence
    (no need to read back what was just written), else its whole context from the cache."""
    if plan.blocks is None:
        return k, v
    context = plan.start + plan.num_new
    keys = gather_blocks(k_cache, plan.blocks).flatten(0, 1)[:context]
    return keys, gather_blocks(v_cache, plan.blocks).flatten(0, 1)[:context]


def _decode_attention(q, k_cache, v_cache, plan: _DecodePlan, mask, scale) -> torch.Tensor:
    d, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys, values = _decode_context(k_cache, v_cache, plan)  # (D, kv_heads, L, head_dim) each
    # One query per sequence: the query heads sharing a KV head become that head's query rows (what transformers'
    # pack_gqa does for decode). Same head mapping as enable_gqa (query head h reads KV head h // group), ~2x faster.
    packed = q.view(d, kv_heads, heads // kv_heads, head_dim)  # (D, kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)  # (D, kv_heads, group, hd)
    return out.reshape(d, heads, head_dim)


def prefill_attention(q, k, v, k_cache, v_cache, plan: _PrefillPlan, mask, scale) -> torch.Tensor:
    """One prefill chunk (n, heads, head_dim) against its whole context: fresh k/v when it starts at 0, else the cache."""
    keys, values = _chunk_context(k, v, k_cache, v_cache, plan)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # (1, heads, n, head_dim)
    return out[0].transpose(0, 1)


def paged_attention_with_sinks(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window, sinks):
    """paged_attention with gpt-oss's sinks (heads,): each head's learned logit joins every softmax's denominator
    (and no value), in transformers' eager order: scores, mask, the sink appended, the max subtracted, softmax."""
    k_cache[meta.write_blocks, meta.write_offsets] = k
    v_cache[meta.write_blocks, meta.write_offsets] = v
    decode_masks, prefill_masks = meta.masks(window, q.dtype)
    out = torch.empty_like(q)  # (T, heads, head_dim)
    for plan, mask in zip(meta.decode, decode_masks):
        keys, values = _decode_context(k_cache, v_cache, plan)
        out[plan.rows] = _sink_softmax(q[plan.rows][:, :, None], keys, values, mask, scale, sinks)[:, :, 0]
    for plan, mask in zip(meta.prefills, prefill_masks):
        rows = slice(plan.row, plan.row + plan.num_new)
        keys, values = _chunk_context(k[rows], v[rows], k_cache, v_cache, plan)
        if mask is None:  # a chunk starting its sequence, within its window: the mask SDPA's is_causal would make
            mask = meta.causal_mask(plan.num_new, window, q.dtype)
        attended = _sink_softmax(q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                 values.transpose(0, 1)[None], mask, scale, sinks)  # (1, heads, n, head_dim)
        out[rows] = attended[0].transpose(0, 1)
    return out


def _sink_softmax(q, keys, values, mask, scale, sinks) -> torch.Tensor:
    """q (B, heads, n, d), keys/values (B, kv_heads, L, d), mask additive (B | 1, 1, n, L) or None -> (B, heads, n, d)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # (B, heads, n, L)
    if mask is not None:
        scores = scores + mask
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)  # (B, heads, n, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
