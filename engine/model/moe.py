"""The sparse MLP of mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, gpt-oss): a router
picks top_k experts per token (DeepSeek's only from its best groups where configured); each expert is a SiLU-gated
MLP (Qwen2-MoE adds a shared expert every token takes, gated by a sigmoid; DeepSeek ungated ones), or gpt-oss's
clamped SwiGLU with biases.
Tokens are grouped by expert, so one step runs one gate/up and one down matmul per expert it hit, whatever the number
of tokens; the experts' outputs are summed in ascending expert order, as transformers' loop does, so fp32 results
match its own. Each SiLU expert's projections are `Linear`s: packed for oneDNN like the dense layers' where the CPU
runs the dtype there (gpt-oss's stacked experts multiply as transformers does, unpacked)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelSpec
from engine.model.kernels import TorchOps
from engine.model.linear import Linear
from engine.parallel.shard import Shard


class Expert(nn.Module):
    """One SiLU-gated MLP: w2(silu(gate) * up), gate and up from one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: TorchOps):
        super().__init__()
        self.w13 = Linear(hidden_size, 2 * intermediate_size, bias=False)  # gate rows, then up rows
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.w2(self.ops.silu_and_mul(self.w13(x)))


class ClampedSwigluExperts(nn.Module):
    """gpt-oss's experts, held as its checkpoint holds them: gate_up_proj (experts, hidden, 2 * width) with gate and
    up columns interleaved, down_proj (experts, width, hidden), and their biases. experts[e](x) runs expert e as
    transformers' loop does. Under tensor parallelism a rank holds each expert's width slice (its interleaved pairs
    are contiguous columns); down_proj's bias is added by rank 0 alone."""

    def __init__(self, hidden_size: int, width: int, num_experts: int, limit: float, alpha: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.limit, self.alpha = limit, alpha

    def __getitem__(self, expert: int):
        return functools.partial(self.run, expert)

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]  # (T, 2 * width)
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # (T, width)
        return gated @ self.down_proj[expert] + self.down_proj_bias[expert]


class Router(nn.Module):
    """The router's weight (experts, hidden), read by F.linear as transformers reads it (never packed: its logits
    choose experts); gpt-oss's bias; DeepSeek-V3's per-expert correction bias, added to the scores that choose experts
    only."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if correction_bias else None


class SparseMoe(nn.Module):
    """Under tensor parallelism each rank holds a slice of every expert's width (engine/parallel/shard.py says why)
    and a whole router: its output is this rank's part of the sum."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, shard: Shard):
        super().__init__()
        moe = spec.moe
        self.moe = moe
        self.gate = Router(spec.hidden_size, moe.num_experts, bias=moe.scoring == "topk_softmax",
                           correction_bias=moe.scoring == "sigmoid")
        width = moe.intermediate_size // shard.size
        if moe.swiglu_limit is not None:
            self.experts = ClampedSwigluExperts(spec.hidden_size, width, moe.num_experts, moe.swiglu_limit,
                                                moe.swiglu_alpha)
        else:
            self.experts = nn.ModuleList(Expert(spec.hidden_size, width, ops) for _ in range(moe.num_experts))
        if moe.shared_intermediate_size:
            self.shared_expert = Expert(spec.hidden_size, moe.shared_intermediate_size // shard.size, ops)
        if moe.shared_intermediate_size and moe.shared_gated:
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def keep_router_float32(self) -> None:
        """DeepSeek keeps its router in float32 whatever the model's dtype (transformers'
        _keep_in_fp32_modules_strict); the other routers run in the model's."""
        if self.moe.router_float32:
            self.gate.float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, top_k), experts (T, top_k) long), as the family's router computes them."""
        if self.moe.scoring == "sigmoid":
            return self._grouped_route(x)
        if self.moe.scoring == "topk_softmax":  # gpt-oss: the softmax of the top logits, in the model's dtype
            top, experts = torch.topk(F.linear(x, self.gate.weight, self.gate.bias), self.moe.top_k, dim=-1)
            return F.softmax(top, dim=1, dtype=top.dtype), experts
        moe = self.moe
        logits = F.linear(x.float(), self.gate.weight) if moe.router_float32 else F.linear(x, self.gate.weight)
        probs = F.softmax(logits.float(), dim=-1)  # (T, experts) float32
        if moe.num_groups > 1:  # DeepSeek-V2's group_limited_greedy: the groups with the highest best expert
            best = probs.view(x.shape[0], moe.num_groups, -1).max(dim=-1).values  # (T, groups)
            groups = torch.topk(best, k=moe.topk_groups, dim=-1, sorted=False)[1]  # (T, topk_groups)
            keep = torch.zeros_like(best).scatter_(1, groups, 1).bool()  # (T, groups)
            probs = probs.masked_fill(~keep[:, :, None].expand(-1, -1, moe.num_experts // moe.num_groups)
                                      .reshape(x.shape[0], -1), 0.0)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)  # (T, top_k)
        if moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return (weights.to(x.dtype) if moe.weights_in_model_dtype else weights), experts

    def _grouped_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's: float32 weights (T, top_k), experts (T, top_k), in DeepseekV3TopkRouter's ops and order."""
        moe, t = self.moe, x.shape[0]
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # (T, experts)
        choice = scores + self.gate.e_score_correction_bias  # (T, experts)
        grouped = choice.view(t, moe.num_groups, -1)  # (T, groups, experts per group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, groups): each group's best two
        groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]  # (T, topk_groups)
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()  # (T, groups)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, -1), float("-inf"))
        experts = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]  # (T, top_k)
        weights = scores.gather(1, experts)  # (T, top_k)
        if moe.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        out = self._routed(x)
        if not self.moe.shared_intermediate_size:
            return out
        shared = self.shared_expert(x)  # (T, hidden)
        if not self.moe.shared_gated:
            return out + shared
        return out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared  # transformers' order

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The top-k experts' weighted sum: x (T, hidden) -> (T, hidden)."""
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
            h = self.experts[expert](x[tokens]) * flat_weights[pairs, None]  # (count, hidden)
            out.index_add_(0, tokens, h.to(out.dtype))
        return out
