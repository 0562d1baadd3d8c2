"""Block manager: block tables, reference counts and the prefix cache. It never touches KV data; copies it asks for
are returned.

Prefix cache: a full block whose KV is computed is entered under its key (engine/kv/block_hash.py). When no sequence
references it any more it is not forgotten but becomes *evictable*: still findable, counted as free, and taken back
(LRU first) only when a fresh block is needed and no never-cached block is left. A later prompt with the same prefix
takes a reference on those blocks instead of computing them. Only full blocks are ever shared; a sequence's partial
last block is its own (fork copies it).

Layer groups (engine/kv/kv_cache.py): a sequence has one block table per group, all over this one pool, all indexed by
the same logical block (position // block_size). A sliding-window group's blocks that no later query can see (wholly
behind the window of the next position) are released as the sequence advances, and their entries become PLACEHOLDER;
released blocks that are cached stay findable until evicted, so a later prompt with the same prefix still finds the
window it needs. A cache hit must hold every full group's blocks of the run and each window group's blocks within the
window of the first position computed after it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from engine.core.request import Sequence

_KEY_BYTES = 16  # a prefix-cache key (engine/kv/block_hash.py); other layer groups' keys append their group's index
PLACEHOLDER = -1  # a window group's table entry whose block was released: no query reads it


def request_blocks(num_prompt_tokens: int, max_tokens: int, num_candidates: int, block_size: int,
                   windows: tuple[int | None, ...] = (None,), max_chunk: int | None = None) -> int:
    """The most KV blocks one request holds at once, summed over the layer groups (their windows): per full group its
    prompt's full blocks, shared by its candidates (fork), and each candidate's own blocks for the rest of the prompt
    and max_tokens; per window group at most each candidate's window plus one step's chunk (max_chunk tokens; None:
    the whole prompt at once). The one admission rule: the edge and the engine both refuse a request that needs more
    than a pool holds."""
    own = -(-(num_prompt_tokens % block_size + max_tokens) // block_size)
    whole = num_prompt_tokens // block_size + num_candidates * own
    step = min(max(1, num_prompt_tokens if max_chunk is None else max_chunk), num_prompt_tokens + max_tokens)

    def windowed(window: int) -> int:  # blocks touching a window and a step's chunk, for each candidate
        return num_candidates * (-(-(step + window - 1) // block_size) + 1)

    return sum(whole if w is None else min(whole, windowed(w)) for w in windows)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)  # per layer group: its sliding window, None for full attention
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
        """Every key the prefix cache holds for the first layer group, 16 bytes each, concatenated: what a router
        summarises to send prompts where their prefix is. Read-only; a copy, so it may go stale but never changes
        under the reader."""
        return b"".join(k for k in self._block_of if len(k) == _KEY_BYTES)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def request_blocks(self, num_prompt_tokens: int, max_tokens: int, num_candidates: int, max_chunk: int) -> int:
        return request_blocks(num_prompt_tokens, max_tokens, num_candidates, self.block_size, self.windows, max_chunk)

    def floor(self, group: int, num_tokens: int) -> int:
        """Leading logical blocks of a group that no query at a position >= num_tokens sees: 0 for full attention."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def _key(self, key: bytes, group: int) -> bytes:
        return key if group == 0 else key + bytes([group])

    # ---- the prefix cache ----
    def lookup(self, keys: list[bytes], import_tokens: int | None = None) -> list[list[int]]:
        """Per layer group, the table of the longest run of these leading block keys every group can resume from
        (a window group's blocks behind the window are PLACEHOLDER). A computed sequence resumes at the run's end;
        an imported one (import_tokens: the prompt read) after the whole prompt, so a window group needs only the
        blocks of that window. Mutates nothing."""
        hit = len(keys) if self.enable_prefix_caching else 0
        for group, window in enumerate(self.windows):
            if window is None:
                hit = next((i for i in range(hit) if self._key(keys[i], group) not in self._block_of), hit)

        def low(group: int, hit: int) -> int:
            return self.floor(group, hit * self.block_size if import_tokens is None else import_tokens)

        while hit and not all(self._key(keys[i], g) in self._block_of for g, w in enumerate(self.windows)
                              if w is not None for i in range(low(g, hit), hit)):
            hit -= 1
        tables = [[PLACEHOLDER] * min(low(g, hit), hit) for g in range(self.num_groups)]
        for group, table in enumerate(tables):
            table.extend(self._block_of[self._key(keys[i], group)] for i in range(len(table), hit))
        return tables

    def can_admit(self, seq: Sequence, cached: list[list[int]], num_new_tokens: int, importing: bool = False) -> bool:
        """Whether seq (holding no blocks yet) can take the cached blocks and fresh ones for num_new_tokens more
        (importing: their KV is read, not computed, so a window group takes only the window's)."""
        fresh = self._fresh(cached, len(cached[0]) * self.block_size + num_new_tokens, importing)
        revived = sum(1 for table in cached for b in table if b >= 0 and self._ref_counts[b] == 0)  # evictable
        return fresh + revived <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[list[int]]) -> None:
        """Gives seq (holding no blocks yet) references on the cached blocks, as the start of its block tables."""
        assert not any(seq.block_tables), "admit: the sequence already holds blocks"
        for table in cached:
            for block in table:
                if block < 0:
                    continue
                if self._ref_counts[block] == 0:
                    del self._evictable[block]
                self._ref_counts[block] += 1
        seq.block_tables = [list(table) for table in cached]
        seq.num_registered_blocks = len(cached[0])

    def register(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Enters seq's blocks that are full and computed into the cache, under seq.block_hashes (which must cover
        them). A key already cached elsewhere keeps its first block; this one stays private."""
        if not self.enable_prefix_caching:
            return
        tables = seq.block_tables
        full = min(num_computed_tokens // self.block_size, len(tables[0]), len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, full):
            for group, table in enumerate(tables):
                key, block = self._key(seq.block_hashes[i], group), table[i]
                if block >= 0 and key not in self._block_of and block not in self._key_of:
                    self._block_of[key], self._key_of[block] = block, key
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    # ---- allocation ----
    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        return seq.block_tables

    def _missing(self, seq: Sequence, num_new_tokens: int, importing: bool = False) -> int:
        return self._fresh(self._tables(seq), seq.num_computed_tokens + num_new_tokens, importing)

    def _fresh(self, tables: list[list[int]], end: int, importing: bool) -> int:
        """Blocks the tables lack to cover positions [0, end) (importing: a window group's from its window on)."""
        return sum(max(0, self.blocks_for(end) - max(len(t), self.floor(g, end) if importing else 0))
                   for g, t in enumerate(tables))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the blocks to hold num_new_tokens more computed tokens of seq are free."""
        return self._missing(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, importing: bool = False) -> None:
        """Grows seq's block tables with fresh blocks so they cover num_computed_tokens + num_new_tokens positions.
        importing: that KV will be read, not computed, so a window group's entries behind the window of the end
        stay PLACEHOLDER."""
        missing = self._missing(seq, num_new_tokens, importing)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"allocate: {missing} blocks needed, {self.num_free_blocks} free "
                               "(call can_allocate first)")
        end = seq.num_computed_tokens + num_new_tokens
        for group, table in enumerate(self._tables(seq)):
            if importing and len(table) < (low := self.floor(group, end)):
                table.extend([PLACEHOLDER] * (low - len(table)))
            table.extend(self._take() for _ in range(self.blocks_for(end) - len(table)))

    def release_behind_window(self, seq: Sequence) -> None:
        """Releases each window group's blocks that no query of seq from its next position on sees."""
        for group, table in enumerate(seq.block_tables):
            low = min(self.floor(group, seq.num_computed_tokens), len(table))
            for i in range(low - 1, -1, -1):
                if table[i] < 0:
                    break  # released with everything before it on an earlier step
                self._release(table[i])
                table[i] = PLACEHOLDER

    def trim(self, seq: Sequence) -> None:
        """Releases seq's blocks past those its tokens need (held for drafts that were rejected)."""
        end = self.blocks_for(seq.num_tokens)
        for table in seq.block_tables:
            while len(table) > end:
                block = table.pop()
                if block >= 0:
                    self._release(block)

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; a block returns to the pool when no sequence holds it. Idempotent. The last
        blocks are freed first, so under eviction pressure a prompt's tail goes before its (more shared) head."""
        for table in seq.block_tables:
            for block in reversed(table):
                if block >= 0:
                    self._release(block)
        seq.block_tables = []
        seq.num_registered_blocks = 0

    def lease_blocks(self, seq: Sequence, num_tokens: int) -> tuple[list[int], list[int]]:
        """The blocks of seq holding positions [0, num_tokens) that it still holds, group after group, and the
        logical block each group's list starts at (a window group's earlier ones were released): a KV handle's."""
        end = self.blocks_for(num_tokens)
        starts = [next((i for i, b in enumerate(t[:end]) if b >= 0), end) for t in seq.block_tables]
        return [b for t, s in zip(seq.block_tables, starts) for b in t[s:end]], starts

    def can_fork(self) -> bool:
        return self.num_free_blocks >= self.num_groups

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Shares parent's full blocks with child; a partly filled last block gets a private copy for child (one
        per layer group). Returns the (src, dst) pairs whose block data must be copied. child must hold no blocks."""
        assert not any(child.block_tables), "fork: child already holds blocks"
        end = self.blocks_for(parent.num_computed_tokens)
        partial = parent.num_computed_tokens % self.block_size != 0
        child.block_tables, copies = [], []
        for table in parent.block_tables:
            shared = table[: end - 1] if partial else table[:end]
            for block in shared:
                if block >= 0:
                    self._ref_counts[block] += 1
            child.block_tables.append(list(shared))
            if partial:
                copies.append((table[end - 1], self._take()))
                child.block_tables[-1].append(copies[-1][1])
        child.num_registered_blocks = min(parent.num_registered_blocks, end - partial)
        return copies

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
