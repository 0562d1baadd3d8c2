"""The paged KV block pool: one arena tensor, block-major, so one block is one contiguous span of memory.

Block-major means a block holds the keys and values of all layers for `block_size` consecutive positions of one
sequence (for latent attention, each layer's latents: one plane instead of two). A KV transfer then moves one
descriptor per block, and a block copy (copy-on-write for n > 1) is one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelSpec
from engine.parallel.shard import SINGLE, Shard, kv_head_range


@dataclass(frozen=True)
class KVLayout:
    """An engine's KV blocks: what two engines must agree on before they exchange blocks (all but the tensor-parallel
    split, which a reader bridges by reading each rank's heads where the other side holds them: engine/kv/head_reads.py)."""

    num_layers: int
    num_kv_heads: int  # in one rank's pool
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    tp_size: int = 1  # tensor-parallel ranks, each with a pool of its KV heads
    model_kv_heads: int = 0  # the whole model's KV heads; 0 is filled in as num_kv_heads (one rank)
    # Per layer: 2 planes (keys, values) of (block_size, num_kv_heads, head_dim), or 1 for latent attention (MLA):
    # one "head" of kv_lora_rank + qk_rope_head_dim per token, the same on every tensor-parallel rank.
    planes: int = 2

    def __post_init__(self):
        if not self.model_kv_heads:
            object.__setattr__(self, "model_kv_heads", self.num_kv_heads)

    @classmethod
    def of(cls, spec: ModelSpec, block_size: int, dtype: str, shard: Shard = SINGLE) -> KVLayout:
        """A model's KV layout at a block size and run dtype, in one rank's pool: the one rule, used by the engine
        and by the edge (which sizes its limits from it before any engine exists)."""
        if spec.mla is not None:
            return cls(spec.num_layers, 1, spec.mla.latent_dim, block_size, dtype, shard.size, 1, planes=1)
        return cls(spec.num_layers, shard.num_kv_heads(spec), spec.head_dim, block_size, dtype, shard.size,
                   spec.num_kv_heads)

    def rank_heads(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the model's KV heads that rank `rank`'s pool holds, in this order in each block."""
        return kv_head_range(self.model_kv_heads, self.tp_size, rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * self.planes * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """Owns the arena; hands out per-layer views. It knows nothing of which request owns which block."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # (num_blocks, num_layers, planes, block_size, num_kv_heads, head_dim)
        self.arena = torch.zeros(
            (num_blocks, layout.num_layers, layout.planes, layout.block_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.torch_dtype,
            device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Views (no copy) of layer i's planes (keys and values, or latents), each (num_blocks, block_size,
        num_kv_heads, head_dim)."""
        return self.arena[:, i].unbind(1)

    def copy_block(self, src: int, dst: int) -> None:
        """Copies every layer of block src into block dst (copy-on-write when a sequence forks)."""
        self.arena[dst].copy_(self.arena[src])

    def block_ptr(self, block_id: int) -> int:
        """Address of a block's first byte: transports describe blocks by (address, block_bytes)."""
        return self.arena[block_id].data_ptr()
