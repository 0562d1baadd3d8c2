"""The paged KV block pool: one arena tensor, block-major, so one block is one contiguous span of memory.

Block-major means a block holds the keys and values of a group's layers for `block_size` consecutive positions of one
sequence (for latent attention, each layer's latents: one plane instead of two). A KV transfer then moves one
descriptor per block, and a block copy (copy-on-write for n > 1) is one copy.

Layer groups: a model whose layers all attend alike has one group, all its layers, so a block holds every layer. A model
with sliding-window layers (Gemma 3, gpt-oss, Mistral) groups its layers by window, in groups of equal size (the
largest size that splits every window's layers), and a sequence has one block table per group over the one shared
pool (as vLLM's hybrid allocator). A window group's blocks behind its window are freed while the sequence runs
(engine/kv/block_manager.py), and a hand-off moves only those still held.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
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
    # Per layer: its sliding window (None: full attention); () when every layer attends in full.
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self):
        if not self.model_kv_heads:
            object.__setattr__(self, "model_kv_heads", self.num_kv_heads)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))  # a list when parsed from JSON
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    @classmethod
    def of(cls, spec: ModelSpec, block_size: int, dtype: str, shard: Shard = SINGLE) -> KVLayout:
        """A model's KV layout at a block size and run dtype, in one rank's pool: the one rule, used by the engine
        and by the edge (which sizes its limits from it before any engine exists)."""
        if spec.mla is not None:
            return cls(spec.num_layers, 1, spec.mla.latent_dim, block_size, dtype, shard.size, 1, planes=1)
        windows = spec.sliding_windows if any(w is not None for w in spec.sliding_windows) else ()
        return cls(spec.num_layers, shard.num_kv_heads(spec), spec.head_dim, block_size, dtype, shard.size,
                   spec.num_kv_heads, layer_windows=windows)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The layer groups, each with a block table of its own: full-attention layers first, then by window."""
        return kv_groups(self.layer_windows, self.num_layers)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def block_layers(self) -> int:
        """Layers in one block: a group's."""
        return len(self.groups[0].layers)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot in the group's blocks) of a layer."""
        return _places(self.layer_windows, self.num_layers)[layer]

    def rank_heads(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the model's KV heads that rank `rank`'s pool holds, in this order in each block."""
        return kv_head_range(self.model_kv_heads, self.tp_size, rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.block_layers * self.planes * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]


@functools.cache
def kv_groups(layer_windows: tuple[int | None, ...], num_layers: int) -> tuple[KVGroup, ...]:
    """Layers grouped by window in groups of equal size: the greatest common divisor of the windows' layer counts,
    so every block of the shared pool is the same size whichever group holds it (Gemma 3's 5:1 over 6 layers: one
    full group and five window groups of one layer; gpt-oss's 1:1: as many of each)."""
    if not layer_windows:
        return (KVGroup(None, tuple(range(num_layers))),)
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(by_window[w][i:i + size])) for w in order for i in range(0, len(by_window[w]), size))


@functools.cache
def _places(layer_windows: tuple[int | None, ...], num_layers: int) -> tuple[tuple[int, int], ...]:
    place = {layer: (g, slot) for g, group in enumerate(kv_groups(layer_windows, num_layers))
             for slot, layer in enumerate(group.layers)}
    return tuple(place[layer] for layer in range(num_layers))


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on transparent huge pages where the kernel offers them (madvise mode, the common default).
    Decode attention gathers each sequence's rows block by block from all over the arena; on 4 KiB pages nearly every
    block costs TLB misses, and 2 MiB pages cut the attention's time by about a tenth (docs/performance.md)."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled by the kernel
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE on this OS, or THP off: small pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps buf alive


class KVCache:
    """Owns the arena; hands out per-layer views. It knows nothing of which request owns which block."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # (num_blocks, block_layers, planes, block_size, num_kv_heads, head_dim)
        shape = (num_blocks, layout.block_layers, layout.planes, layout.block_size, layout.num_kv_heads,
                 layout.head_dim)
        if torch.device(device).type == "cpu":
            self.arena = host_zeros(shape, layout.torch_dtype)
        else:
            self.arena = torch.zeros(shape, dtype=layout.torch_dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Views (no copy) of layer i's planes (keys and values, or latents), each (num_blocks, block_size,
        num_kv_heads, head_dim): its slot in every block (only its group's block tables index them)."""
        return self.arena[:, self.layout.place(i)[1]].unbind(1)

    def copy_block(self, src: int, dst: int) -> None:
        """Copies block src (its group's layers) into block dst (copy-on-write when a sequence forks)."""
        self.arena[dst].copy_(self.arena[src])

    def block_ptr(self, block_id: int) -> int:
        """Address of a block's first byte: transports describe blocks by (address, block_bytes)."""
        return self.arena[block_id].data_ptr()
