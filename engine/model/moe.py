"""The sparse MLP of mixture-of-experts models (Qwen3-MoE, Mixtral): a router picks top_k experts per token; each
expert is a SiLU-gated MLP. Tokens are grouped by expert, so one step runs one gate/up and one down matmul per expert
it hit, whatever the number of tokens; the experts' outputs are summed in ascending expert order, as transformers'
loop does, so fp32 results match its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelSpec
from engine.model.kernels import TorchOps


class SparseMoe(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps):
        super().__init__()
        moe = spec.moe
        self.moe, self.ops = moe, ops
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)  # the router
        # (experts, 2 * intermediate, hidden): each expert's gate rows then up rows, as one matmul
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, spec.hidden_size))
        # (experts, hidden, intermediate)
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size, moe.intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, top_k), experts (T, top_k) long), as the family's router computes them."""
        probs = F.softmax(F.linear(x, self.gate.weight).float(), dim=-1)  # (T, experts) float32
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)  # (T, top_k)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.moe.weights_in_model_dtype else weights), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        weights, experts = self.route(x)
        flat = experts.flatten()  # (T * top_k,) token t's choices at t * top_k ...
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        flat_weights = weights.flatten()  # (T * top_k,)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]  # (count,)
            start += count
            tokens = pairs // self.moe.top_k  # (count,) each token at most once per expert
            h = self.ops.silu_and_mul(F.linear(x[tokens], self.w13[expert]))  # (count, intermediate)
            h = F.linear(h, self.w2[expert]) * flat_weights[pairs, None]  # (count, hidden)
            out.index_add_(0, tokens, h.to(out.dtype))
        return out
