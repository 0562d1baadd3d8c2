"""Block manager: block tables and reference counts. It never touches KV data; copies it asks for are returned."""

from __future__ import annotations

from collections import deque

import torch

from engine.request import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))  # block 0 is taken first
        self._ref_counts = [0] * num_blocks
        # Allocation count per block. A reader on another engine compares it after reading a block: a changed
        # count means the block was freed and reused meanwhile, so the data read cannot be trusted.
        self.generations = torch.zeros(num_blocks, dtype=torch.int64)  # (num_blocks,)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the blocks to hold num_new_tokens more computed tokens of seq are free."""
        return self._missing(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq.block_table so it covers num_computed_tokens + num_new_tokens positions."""
        missing = self._missing(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"allocate: {missing} blocks needed, {len(self._free)} free (call can_allocate first)")
        for _ in range(missing):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; a block returns to the pool when no sequence holds it. Idempotent."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def can_fork(self) -> bool:
        return len(self._free) >= 1

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Shares parent's full blocks with child; a partly filled last block gets a private copy for child.

        Returns (src, dst) when block data must be copied, else None. child must hold no blocks yet.
        """
        assert not child.block_table, "fork: child already holds blocks"
        table = parent.block_table[: self.blocks_for(parent.num_computed_tokens)]
        partial = parent.num_computed_tokens % self.block_size != 0
        shared = table[:-1] if partial else table
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = list(shared)
        if not partial:
            return None
        dst = self._take()
        child.block_table.append(dst)
        return table[-1], dst

    def _take(self) -> int:
        block = self._free.pop()  # the most recently freed block: likeliest still in the CPU's caches
        self._ref_counts[block] = 1
        self.generations[block] += 1
        return block

    def _release(self, block: int) -> None:
        if self._ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was allocated")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)
