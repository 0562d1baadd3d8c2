"""Block manager: block tables, reference counts and the prefix cache. It never touches KV data; copies it asks for
are returned.

Prefix cache: a full block whose KV is computed is entered under its key (engine/kv/block_hash.py). When no sequence
references it any more it is not forgotten but becomes *evictable*: still findable, counted as free, and taken back
(LRU first) only when a fresh block is needed and no never-cached block is left. A later prompt with the same prefix
takes a reference on those blocks instead of computing them. Only full blocks are ever shared; a sequence's partial
last block is its own (fork copies it).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from engine.core.request import Sequence


def request_blocks(num_prompt_tokens: int, max_tokens: int, num_candidates: int, block_size: int) -> int:
    """The most KV blocks one request holds at once: its prompt's full blocks, shared by its candidates (fork), and
    each candidate's own blocks for the rest of the prompt and max_tokens. The one admission rule: the edge and the
    engine both refuse a request that needs more than a pool holds."""
    own = -(-(num_prompt_tokens % block_size + max_tokens) // block_size)
    return num_prompt_tokens // block_size + num_candidates * own


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))  # never cached (or evicted); block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently freed first
        self._ref_counts = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block -> its prefix-cache key
        self._block_of: dict[bytes, int] = {}  # prefix-cache key -> block
        self.num_evictions = 0
        # Allocation count per block. A reader on another engine compares it after reading a block: a changed
        # count means the block was freed and reused meanwhile, so the data read cannot be trusted. A cache hit
        # reuses a block's data as it is, so it does not count.
        self.generations = torch.zeros(num_blocks, dtype=torch.int64)  # (num_blocks,)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def cached_keys(self) -> bytes:
        """Every key the prefix cache holds, 16 bytes each, concatenated: what a router summarises to send
        prompts where their prefix is. Read-only; a copy, so it may go stale but never changes under the reader."""
        return b"".join(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the prefix cache ----
    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks holding the longest cached run of these leading block keys. Mutates nothing."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether seq (holding no blocks yet) can take the cached blocks and fresh ones for num_new_tokens more."""
        fresh = self.blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        revived = sum(1 for b in cached if self._ref_counts[b] == 0)  # evictable now, so counted as free
        return fresh + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Gives seq (holding no blocks yet) references on the cached blocks, as the start of its block table."""
        assert not seq.block_table, "admit: the sequence already holds blocks"
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)

    def register(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Enters seq's blocks that are full and computed into the cache, under seq.block_hashes (which must cover
        them). A key already cached elsewhere keeps its first block; this one stays private."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed_tokens // self.block_size, len(seq.block_table), len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, full):
            key, block = seq.block_hashes[i], seq.block_table[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    # ---- allocation ----
    def _missing(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the blocks to hold num_new_tokens more computed tokens of seq are free."""
        return self._missing(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq.block_table with fresh blocks so it covers num_computed_tokens + num_new_tokens positions."""
        missing = self._missing(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"allocate: {missing} blocks needed, {self.num_free_blocks} free "
                               "(call can_allocate first)")
        for _ in range(missing):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; a block returns to the pool when no sequence holds it. Idempotent. The last
        blocks are freed first, so under eviction pressure a prompt's tail goes before its (more shared) head."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def can_fork(self) -> bool:
        return self.num_free_blocks >= 1

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
        child.num_registered_blocks = min(parent.num_registered_blocks, len(shared))
        if not partial:
            return None
        dst = self._take()
        child.block_table.append(dst)
        return table[-1], dst

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()  # the most recently freed block: likeliest still in the CPU's caches
        else:
            block, _ = self._evictable.popitem(last=False)  # the least recently used cached block
            del self._block_of[self._key_of.pop(block)]
            self.num_evictions += 1
        self._ref_counts[block] = 1
        self.generations[block] += 1
        return block

    def _release(self, block: int) -> None:
        if self._ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was allocated")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def check(self) -> None:
        """Asserts the accounting: every block is exactly one of free, evictable or referenced, and the cache maps
        agree. For tests and debugging; O(num_blocks)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)[:5]}"
        for block, refs in enumerate(self._ref_counts):
            idle = block in free or block in evictable
            assert (refs == 0) == idle, f"block {block}: {refs} references but {'free' if idle else 'not free'}"
            assert block not in evictable or block in self._key_of, f"block {block} evictable but not cached"
            assert block not in free or block not in self._key_of, f"block {block} free but still cached"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "prefix-cache maps disagree"
