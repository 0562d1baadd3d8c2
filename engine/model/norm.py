"""RMSNorm, as transformers' families compute it (through `ops`: the C++ kernel or its torch reference)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.kernels import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)); x may be overwritten with the sum."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
