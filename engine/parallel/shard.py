"""Which part of the model one tensor-parallel rank holds, and the one collective the model needs.

The layout is vLLM's (and Megatron's): q/k/v and gate/up projections are split by output rows (column parallel), each
rank holding whole heads and a slice of the MLP; o_proj and down_proj are split by input columns (row parallel), so
each rank's output is a partial sum the ranks add up (all-reduce). A mixture-of-experts layer is sharded the same
way inside every expert (each rank holds a slice of every expert), not spread by expert: on a handful of ranks that
keeps every rank's work equal whatever the router picks, and needs the one all-reduce a dense MLP needs. The
embedding table and the LM head are split by vocabulary rows: each rank looks up the ids it holds (zeros for the
others) and computes its rows' logits, and the sum over the ranks is the whole (one all-reduce each). The router and
the norms are replicated. With more ranks than KV heads, each KV head is held by several ranks (those whose query
heads read it), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import ModelSpec


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`. all_reduce sums a partial result over the ranks, in place; one rank needs none."""

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")
        if self.size > 1 and self.all_reduce is None:
            raise ValueError("a tensor-parallel shard of several ranks needs an all_reduce")

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (the same tensor on all of them afterwards)."""
        return x if self.size == 1 else self.all_reduce(x)

    def split(self, n: int) -> slice:
        """This rank's equal part of n rows (or columns)."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def heads(self, spec: ModelSpec) -> slice:
        return self.split(spec.num_heads)

    def kv_heads(self, spec: ModelSpec) -> slice:
        """The KV heads this rank's query heads read: a slice of them, or the one head several ranks share."""
        return slice(*kv_head_range(spec.num_kv_heads, self.size, self.rank))

    def num_kv_heads(self, spec: ModelSpec) -> int:
        kv = self.kv_heads(spec)
        return kv.stop - kv.start


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `rank` of `size` holds: an equal slice of them, or, with more ranks than
    heads, the one head each run of size // num_kv_heads consecutive ranks shares."""
    if size <= num_kv_heads:
        return rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
    head = rank // (size // num_kv_heads)
    return head, head + 1


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Raises ValueError naming every dimension that `size` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads {spec.num_heads}")
    kv = spec.num_kv_heads
    if (kv % size if size <= kv else size % kv):
        problems.append(f"num_key_value_heads {kv} (it must divide by, or into, the ranks)")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size {spec.intermediate_size}")
    if spec.moe is not None:
        for name in ("intermediate_size", "shared_intermediate_size"):
            width = getattr(spec.moe, name)
            if width and width % size:
                problems.append(f"the experts' {name} {width}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide {spec.architecture}'s " + ", ".join(problems))


SINGLE = Shard()
