"""Gemma 3's text decoder layer (Gemma3ForCausalLM), over the same attention and paged cache as the Llama family.

What differs from a Llama layer, each as transformers' modeling_gemma3 computes it: RMSNorms scale by (1 + weight)
in float32 before casting back (GemmaRMSNorm), on the hidden state and on each head's q and k; the attention output
and the MLP output are normed before their residual adds (four norms a layer); the MLP is gelu-tanh gated; the softmax
scale is query_pre_attn_scalar ** -0.5; sliding-window layers rotate with a rope of their own (a lower base). The
embeddings (times sqrt(hidden_size)) and the final logit soft-capping are CausalLM's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelSpec
from engine.parallel.shard import Shard


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """attention and MLP built by the caller (CausalLM's, with Gemma's norms, scale and activation)."""

    def __init__(self, spec: ModelSpec, attention: nn.Module, mlp: nn.Module, shard: Shard):
        super().__init__()
        dim, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.shard = shard

    def forward(self, x, cos, sin, meta, *cache) -> torch.Tensor:
        attn = self.shard.reduce(self.self_attn(self.input_layernorm(x), cos, sin, meta, *cache))
        x = x + self.post_attention_layernorm(attn)
        mlp = self.shard.reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(mlp)
