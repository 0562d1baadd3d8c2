"""Linear layers that run on oneDNN's packed weights where the CPU computes their dtype there."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear that can swap its weight for oneDNN's blocked copy of it (pack): on a CPU that runs the dtype in
    oneDNN, the packed matmul reads the weight ~1.4x faster at decode batch sizes (where a step is bound by reading
    the weights) and no slower for prefill; outputs match F.linear to the last bits or within summation order."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.packed: torch.Tensor | None = None
        self.packed_bias: torch.Tensor | None = None  # the bias in the packed matmul's dtype
        self.narrow: torch.dtype | None = None  # widen(): the dtype inputs and outputs keep; math in float32

    def pack(self, free_weight: bool) -> None:
        """free_weight: drop the plain weight (kept when another module shares it, as a tied lm_head does)."""
        self._pack(self.weight.detach(), self.bias, free_weight)

    def widen(self, free_weight: bool) -> None:
        """For a bf16 or fp16 model on a CPU that has no matmul of its own for the dtype (torch then runs a generic
        loop, 4-7x slower on an AVX2 CPU): the weight is kept as float32, packed for oneDNN, and the matmul runs in
        float32 on the inputs widened exactly. Products of two bf16 (fp16) values are exact in float32 and sums are
        float32, as in a native bf16 matmul; the output is rounded to the dtype. Twice the weights' memory."""
        self.narrow = self.weight.dtype
        self._pack(self.weight.detach().float(), None if self.bias is None else self.bias.detach().float(),
                   free_weight)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, free_weight: bool) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        self.packed_bias = bias
        if free_weight:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) -> (T, out_features)."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        pad = -rows % _ROW_BUCKET if rows > _EXACT_ROWS else 0
        if pad:
            x = F.pad(x, (0, 0, 0, pad))  # (T rounded up to the bucket, in_features), zero rows
        if self.narrow is not None:
            x = x.float()
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")[:rows]
        return out if self.narrow is None else out.to(self.narrow)


# oneDNN picks its blocked layout for this many rows; measured on the bench shapes, 16 serves decode steps best and
# costs nothing for prefill chunks of 1024.
_PACK_BATCH_HINT = 16
# oneDNN builds (JIT-compiles) a primitive for each input shape and caches it. Prompts of every length would build
# new ones nearly every prefill: ~345-token prompts of varying length took 18.5 ms a step against 10.5 ms for one
# length (bf16, 1 thread). Row counts above _EXACT_ROWS (decode batches stay exact) are padded to a multiple of
# _ROW_BUCKET (at most 31 rows of zeros), so a few shapes serve every prompt.
_EXACT_ROWS = 64
_ROW_BUCKET = 32


def can_pack(dtype: torch.dtype, device) -> bool:
    """Whether this CPU runs dtype's matmuls in oneDNN (bf16 needs AVX-512 BF16 or AMX; fp16 AVX-512 FP16)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32
