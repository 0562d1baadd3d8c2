"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token caches one latent of kv_lora_rank + qk_rope_head_dim values: its compressed key/value (after
kv_a_layernorm) and its rotated positional key, shared by every head (the "one KV head" of the KV layout, replicated
on every tensor-parallel rank, as vLLM and SGLang hold it). A head's keys are [kv_b_proj's key rows of the latent,
the positional key] and its values kv_b_proj's value rows of the latent.

Prefill chunks expand their context's latents into keys and values, as transformers does, and attend with SDPA.
Decode tokens never expand the cache: each query is absorbed into latent space (its no-rope part times the head's
key rows of kv_b_proj), attends the cached latents directly as one shared key/value head, and the attended latent is
mapped to the head's value by its value rows (DeepSeek-V2's weight absorption). The same sums in another order:
within float rounding of the expanded form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelSpec
from engine.model.attention import AttentionMetadata, gather_blocks
from engine.model.kernels import TorchOps, apply_rope
from engine.model.linear import Linear
from engine.model.norm import RMSNorm
from engine.parallel.shard import Shard

# DeepseekV3Attention builds its q_a and kv_a norms with the RMSNorm default, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    """This rank's heads: q_b_proj (or q_proj) and kv_b_proj split by heads, o_proj by its input columns (its output
    is this rank's part of the sum); the latent projections and norms, and so the cache, are whole on every rank."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, shard: Shard):
        super().__init__()
        mla = self.mla = spec.mla
        self.num_heads = spec.num_heads // shard.size
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(spec.hidden_size, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(mla.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, mla.latent_dim, bias=spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, ops)
        # A plain nn.Linear, never packed: decode reads its weight, per head, to absorb queries and values.
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = Linear(self.num_heads * mla.v_head_dim, spec.hidden_size, bias=spec.o_bias)

    def forward(self, x, cos, sin, meta: AttentionMetadata, latent_cache) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, 1, rope dim), latent_cache (num_blocks, block_size, 1, latent_dim) -> the
        attention output after o_proj (T, hidden)."""
        mla, t = self.mla, x.shape[0]
        q_nope, q_pe = self._queries(x).split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe[:, None], cos, sin)  # (T, heads|1, rope)
        latent = torch.cat((self.kv_a_layernorm(compressed.contiguous()), k_pe[:, 0]), dim=-1)  # (T, latent_dim)
        latent_cache[meta.write_blocks, meta.write_offsets] = latent[:, None]
        out = x.new_empty((t, self.num_heads, mla.v_head_dim))  # (T, heads, v_head_dim)
        decode_masks, prefill_masks = meta.masks(None, x.dtype)
        for plan, mask in zip(meta.decode, decode_masks):
            out[plan.rows] = self._absorbed(q_nope[plan.rows], q_pe[plan.rows], gather_blocks(latent_cache, plan.blocks),
                                            mask)
        for plan, mask in zip(meta.prefills, prefill_masks):
            rows = slice(plan.row, plan.row + plan.num_new)
            if plan.blocks is None:  # the chunk is its whole context
                context = latent[rows]
            else:
                context = gather_blocks(latent_cache, plan.blocks).flatten(0, 1)[: plan.start + plan.num_new, 0]
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], context, mask)
        return self.o_proj(out.reshape(t, -1))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(T, heads, qk_nope_head_dim + qk_rope_head_dim)."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, rope dim): DeepSeek rotates (even, odd) pairs where rope_interleave is set, as transformers'
        apply_rotary_pos_emb_interleave (its output in halves); else halves, as Llama."""
        if not self.mla.rope_interleave:
            return apply_rope(x, cos, sin)
        half = x.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    def _head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: key rows (heads, qk_nope_head_dim, kv_lora_rank), value rows
        (heads, v_head_dim, kv_lora_rank). Views, no copy."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.mla.qk_nope_head_dim + self.mla.v_head_dim, -1)
        return w[:, : self.mla.qk_nope_head_dim], w[:, self.mla.qk_nope_head_dim :]

    def _expanded(self, q_nope, q_pe, context, mask) -> torch.Tensor:
        """One prefill chunk: q (n, heads, ...) against its context's latents (L, latent_dim) expanded into every
        head's keys and values -> (n, heads, v_head_dim)."""
        mla = self.mla
        kv = self.kv_b_proj(context[:, : mla.kv_lora_rank]).view(context.shape[0], self.num_heads, -1)
        k_nope, values = kv.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=-1)  # (L, heads, ...)
        k_pe = context[:, None, mla.kv_lora_rank :].expand(-1, self.num_heads, -1)  # (L, heads, rope)
        keys = torch.cat((k_nope, k_pe), dim=-1)  # (L, heads, qk_dim)
        query = torch.cat((q_nope, q_pe), dim=-1)  # (n, heads, qk_dim)
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                             scale=mla.scale)  # (1, heads, n, v_head_dim)
        return out[0].transpose(0, 1)

    def _absorbed(self, q_nope, q_pe, latents, mask) -> torch.Tensor:
        """Decode tokens q (D, heads, ...) against their cached latents (D, blocks, block_size, 1, latent_dim),
        in latent space -> (D, heads, v_head_dim)."""
        w_key, w_value = self._head_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_key).transpose(0, 1)  # (D, heads, kv_lora_rank)
        query = torch.cat((q_latent, q_pe), dim=-1)[:, None]  # (D, 1, heads, latent_dim): the heads share one key
        keys = latents.flatten(1, 2).transpose(1, 2)  # (D, 1, L, latent_dim)
        values = keys[..., : self.mla.kv_lora_rank]  # (D, 1, L, kv_lora_rank)
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.mla.scale)
        # (D, 1, heads, kv_lora_rank) -> each head's value: (heads, D, rank) @ (heads, rank, v_head_dim)
        return torch.bmm(attended[:, 0].transpose(0, 1), w_value.transpose(1, 2)).transpose(0, 1)
