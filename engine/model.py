"""The decoder-only transformer of the Llama family (Llama, Qwen2, Qwen3, Mistral) over a flat batch and a paged cache.

Every op follows transformers' modeling files in order and dtype (see PARITY.md), so greedy tokens match theirs.
q/k/v and gate/up projections are fused into one matmul each: fewer kernel launches, the same dot products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelSpec, load_spec
from engine.kv_cache import KVCache, KVLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, *then* scale: the order transformers uses, which matters in bf16.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim), cos/sin (T, 1, head_dim): rotation by halves (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.splits = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.splits), bias=spec.attention_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        # Qwen3 norms each head of q and k before RoPE.
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.window = spec.sliding_windows[layer_idx]
        self.scale = spec.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, heads, head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, kv_heads, head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # (T, kv_heads, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)  # (T, heads, head_dim)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Construct with from_pretrained; the caller runs forward under torch.inference_mode."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @classmethod
    def from_pretrained(cls, model_dir, dtype: str | None = None, device="cpu") -> CausalLM:
        from engine.loader import load_weights  # the loader names this module's parameters

        spec = load_spec(model_dir)
        dtype = dtype or spec.checkpoint_dtype
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        with torch.device("meta"):  # no memory and no random init for weights about to be overwritten
            model = cls(spec)
        model = model.to(DTYPES[dtype]).to_empty(device=device)
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model._init_rope(device)
        load_weights(model, model_dir)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _init_rope(self, device) -> None:
        # One table for every position: a step then only indexes it. fp32 math, exactly as transformers, then cast.
        inv_freq = torch.tensor(self.spec.rope_inv_freq, dtype=torch.float32, device=device)  # (head_dim // 2,)
        positions = torch.arange(self.spec.max_position_embeddings, device=device).float()  # (P,)
        freqs = positions[:, None] * inv_freq  # (P, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, head_dim)
        scaling = self.spec.rope_attention_scaling
        self.register_buffer("rope_cos", (emb.cos() * scaling).to(self.dtype), persistent=False)  # (P, head_dim)
        self.register_buffer("rope_sin", (emb.sin() * scaling).to(self.dtype), persistent=False)  # (P, head_dim)

    def kv_layout(self, block_size: int) -> KVLayout:
        s = self.spec
        return KVLayout(s.num_layers, s.num_kv_heads, s.head_dim, block_size, str(self.dtype).removeprefix("torch."))

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache, row_embeds=None
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden). positions < max_position_embeddings.

        row_embeds: optional (rows (R,) long, embeddings (R, hidden)) replacing the token embeddings of those flat-batch
        rows: image embeddings at their placeholders (engine/multimodal.py's embeddings_in_span)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if row_embeds is not None:
            rows, embeds = row_embeds
            x[rows] = embeds.to(x.dtype)  # transformers casts the image features to the embeddings' dtype too
        cos = self.rope_cos[positions].unsqueeze(1)  # (T, 1, head_dim)
        sin = self.rope_sin[positions].unsqueeze(1)  # (T, 1, head_dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, *kv_cache.layer(i))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, hidden) -> logits (R, vocab) float32."""
        return F.linear(hidden, self.lm_head.weight).float()
