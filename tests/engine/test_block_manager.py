"""Block manager without a model: tables, reference counts, copy-on-write forks, and the prefix cache."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import update_block_hashes
from engine.kv.block_manager import BlockManager
from engine.core.request import EngineRequest, Sequence
from llmapi import SamplingParams


def seq(num_tokens: int, seq_id: int = 0, tokens: list[int] | None = None, salt: str | None = None) -> Sequence:
    tokens = list(range(num_tokens)) if tokens is None else tokens
    req = EngineRequest(seq_id, list(tokens), SamplingParams(), cache_salt=salt)
    s = Sequence(seq_id, req, 0, list(tokens))
    req.seqs.append(s)
    return s


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocates and 'computes' all of s's tokens, entering its full blocks in the cache."""
    bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    update_block_hashes(s, bm.block_size)
    bm.register(s, s.num_computed_tokens)
    bm.check()
    return s


def test_allocate_grows_tables_and_free_is_idempotent():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(10)
    assert bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    bm.allocate(s, 2)  # position 11 still fits in block 3
    assert len(s.block_table) == 3
    bm.allocate(s, 3)
    assert len(s.block_table) == 4
    bm.free(s)
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_can_allocate_refuses_past_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(9)
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(s, 9)


def test_fork_shares_full_blocks_and_copies_a_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = seq(10, 0), seq(10, 1)
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    copy = bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert copy == (parent.block_table[2], child.block_table[2]) and child.block_table[2] != parent.block_table[2]
    bm.free(parent)
    assert bm.num_free_blocks == 8 - 3  # the shared blocks live on in the child
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_of_a_block_aligned_prompt_copies_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = seq(8, 0), seq(8, 1)
    bm.allocate(parent, 8)
    parent.num_computed_tokens = 8
    assert bm.fork(parent, child) is None and child.block_table == parent.block_table


def test_generation_numbers_change_when_a_block_is_reused():
    bm = BlockManager(num_blocks=1, block_size=4)
    a, b = seq(3, 0), seq(3, 1)
    bm.allocate(a, 3)
    first = int(bm.generations[0])
    bm.free(a)
    bm.allocate(b, 3)
    assert int(bm.generations[0]) == first + 1


def test_a_freed_prompt_is_found_again_and_its_blocks_count_as_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, seq(10))  # blocks: 2 full + 1 partial
    table = list(a.block_table)
    bm.free(a)
    bm.check()
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # the partial block is never cached
    b = seq(10, 1)
    hit = bm.lookup(update_block_hashes(b, 4))
    assert hit == table[:2]
    assert bm.can_admit(b, hit, 2)
    bm.admit(b, hit)
    bm.check()
    assert bm.num_free_blocks == 6 and b.block_table == hit
    b.num_computed_tokens = 8
    bm.allocate(b, 2)
    bm.check()
    assert len(b.block_table) == 3 and bm.num_free_blocks == 5


def test_only_the_same_prefix_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.free(computed(bm, seq(12, 0, tokens=list(range(12)))))
    other_head = seq(12, 1, tokens=[99] + list(range(1, 12)))
    assert bm.lookup(update_block_hashes(other_head, 4)) == []  # the chain: a different first block changes all
    other_tail = seq(12, 2, tokens=list(range(8)) + [99, 9, 10, 11])
    assert len(bm.lookup(update_block_hashes(other_tail, 4))) == 2
    salted = seq(12, 3, tokens=list(range(12)), salt="tenant-b")
    assert bm.lookup(update_block_hashes(salted, 4)) == []  # another tenant's salt isolates it


def test_cached_blocks_are_evicted_lru_and_only_when_a_fresh_block_is_needed():
    bm = BlockManager(num_blocks=6, block_size=4)
    old = computed(bm, seq(8, 0, tokens=list(range(8))))
    new = computed(bm, seq(8, 1, tokens=list(range(100, 108))))
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_evictions == 0
    fresh = seq(8, 2, tokens=list(range(200, 208)))
    bm.allocate(fresh, 8)  # 2 never-cached blocks are left: nothing is evicted
    bm.check()
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 4
    more = seq(4, 3, tokens=list(range(300, 304)))
    bm.allocate(more, 4)  # now a cached block must go: the least recently freed, the tail of `old` first
    bm.check()
    assert bm.num_evictions == 1
    assert len(bm.lookup(update_block_hashes(seq(8, 4, tokens=list(range(8))), 4))) == 1
    assert len(bm.lookup(update_block_hashes(seq(8, 5, tokens=list(range(100, 108))), 4))) == 2


def test_a_shared_cached_block_is_freed_only_by_its_last_holder():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = computed(bm, seq(8))
    b = seq(8, 1)
    hit = bm.lookup(update_block_hashes(b, 4))
    bm.admit(b, hit)
    bm.free(a)
    bm.check()
    assert bm.num_free_blocks == 2  # b still holds both
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 4


def test_a_duplicate_of_a_cached_block_stays_private():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, seq(8))
    b = computed(bm, seq(8, 1))  # computed again without a lookup: same keys, other blocks
    assert bm.num_cached_blocks == 2
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 8 - 2 and bm.lookup(a.block_hashes) == a.block_table


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.free(computed(bm, seq(8)))
    assert bm.num_cached_blocks == 0 and bm.lookup(update_block_hashes(seq(8, 1), 4)) == []
