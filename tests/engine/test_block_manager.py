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
    assert len(s.block_tables[0]) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    bm.allocate(s, 2)  # position 11 still fits in block 3
    assert len(s.block_tables[0]) == 3
    bm.allocate(s, 3)
    assert len(s.block_tables[0]) == 4
    bm.free(s)
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_tables == []


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
    [copy] = bm.fork(parent, child)
    assert child.block_tables[0][:2] == parent.block_tables[0][:2]
    src, dst = parent.block_tables[0][2], child.block_tables[0][2]
    assert copy == (src, dst) and dst != src
    bm.free(parent)
    assert bm.num_free_blocks == 8 - 3  # the shared blocks live on in the child
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_of_a_block_aligned_prompt_copies_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = seq(8, 0), seq(8, 1)
    bm.allocate(parent, 8)
    parent.num_computed_tokens = 8
    assert bm.fork(parent, child) == [] and child.block_tables == parent.block_tables


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
    table = list(a.block_tables[0])
    bm.free(a)
    bm.check()
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # the partial block is never cached
    b = seq(10, 1)
    hit = bm.lookup(update_block_hashes(b, 4))
    assert hit == [table[:2]]
    assert bm.can_admit(b, hit, 2)
    bm.admit(b, hit)
    bm.check()
    assert bm.num_free_blocks == 6 and b.block_tables == hit
    b.num_computed_tokens = 8
    bm.allocate(b, 2)
    bm.check()
    assert len(b.block_tables[0]) == 3 and bm.num_free_blocks == 5


def test_only_the_same_prefix_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.free(computed(bm, seq(12, 0, tokens=list(range(12)))))
    other_head = seq(12, 1, tokens=[99] + list(range(1, 12)))
    assert bm.lookup(update_block_hashes(other_head, 4)) == [[]]  # the chain: a different first block changes all
    other_tail = seq(12, 2, tokens=list(range(8)) + [99, 9, 10, 11])
    assert len(bm.lookup(update_block_hashes(other_tail, 4))[0]) == 2
    salted = seq(12, 3, tokens=list(range(12)), salt="tenant-b")
    assert bm.lookup(update_block_hashes(salted, 4)) == [[]]  # another tenant's salt isolates it


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
    assert len(bm.lookup(update_block_hashes(seq(8, 4, tokens=list(range(8))), 4))[0]) == 1
    assert len(bm.lookup(update_block_hashes(seq(8, 5, tokens=list(range(100, 108))), 4))[0]) == 2


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
    assert bm.num_free_blocks == 8 - 2 and bm.lookup(a.block_hashes) == a.block_tables


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.free(computed(bm, seq(8)))
    assert bm.num_cached_blocks == 0 and bm.lookup(update_block_hashes(seq(8, 1), 4)) == [[]]


# ---- layer groups: a full-attention group and a sliding-window group (window 6, blocks of 4) over one pool ----

def advance(bm: BlockManager, s: Sequence, n: int) -> None:
    """Computes n more tokens of s as the scheduler does: allocate, compute, cache, release behind the window."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    update_block_hashes(s, bm.block_size)
    bm.register(s, s.num_computed_tokens)
    bm.release_behind_window(s)
    bm.check()


def test_a_window_groups_blocks_behind_the_window_return_to_the_pool():
    bm = BlockManager(num_blocks=32, block_size=4, windows=(None, 6))
    s = seq(40)
    for _ in range(40 // 5):
        advance(bm, s, 5)  # chunks of 5 tokens
    full, window = s.block_tables
    assert len(full) == len(window) == 10 and min(full) >= 0
    # the next query (position 40) sees keys 35..40: blocks 8 and 9 hold them, 0..7 were released
    assert window[:8] == [-1] * 8 and min(window[8:]) >= 0
    assert bm.num_free_blocks == 32 - 10 - 2
    other = seq(40, 1, tokens=list(range(100, 140)))
    for _ in range(40 // 5):
        advance(bm, other, 5)  # two sequences of 40 tokens in 32 blocks: 2 x 20 with whole-model tables
    assert bm.num_free_blocks == 32 - 2 * 12
    bm.free(other)
    bm.free(s)
    assert bm.num_free_blocks == 32
    bm.check()


def test_a_window_group_hit_needs_the_window_of_the_resume_point_cached():
    bm = BlockManager(num_blocks=64, block_size=4, windows=(None, 6))
    a = seq(33)
    advance(bm, a, 33)  # prompt of 8 full blocks + 1 token in one chunk: window blocks 0..5 released (cached)
    bm.free(a)
    b = seq(33, 1)
    hit = bm.lookup(update_block_hashes(b, 4))
    # a hit of 8 blocks resumes at position 32, whose window (27..32) needs window blocks 6 and 7
    assert len(hit[0]) == len(hit[1]) == 8 and hit[1][:6] == [-1] * 6 and min(hit[1][6:]) >= 0
    assert bm.can_admit(b, hit, 1)
    bm.admit(b, hit)
    advance(bm, b, 1)
    bm.free(b)
    bm.check()


def test_a_hit_shrinks_to_where_the_window_group_holds_its_window():
    """An imported prompt caches only its window in the window group: the same prompt computed finds every block in
    the full group, but no resume point has its window cached there, so it takes no hit; imported, it does."""
    bm = BlockManager(num_blocks=64, block_size=4, windows=(None, 6))
    imported = seq(33)
    bm.admit(imported, bm.lookup(update_block_hashes(imported, 4)))
    bm.allocate(imported, 33, importing=True)
    imported.num_computed_tokens = 33
    bm.register(imported, 33)
    assert imported.block_tables[1][:6] == [-1] * 6
    keys = update_block_hashes(seq(33, 1), 4)
    # imported again, it resumes after the prompt (position 33, window 28..33): window block 7 is all it needs
    again = bm.lookup(keys, import_tokens=33)
    assert len(again[0]) == 8 and again[1] == [-1] * 7 + imported.block_tables[1][7:8]
    # computed, it resumes at the hit's end: 32 needs window blocks 6 and 7, 28 needs 5 and 6... none is whole
    assert bm.lookup(keys) == [[], []]
    bm.free(imported)
    bm.check()


def test_a_fork_copies_each_groups_partial_block_and_shares_the_rest():
    bm = BlockManager(num_blocks=32, block_size=4, windows=(None, 6))
    parent = seq(18)
    advance(bm, parent, 18)
    child = seq(18, 1)
    copies = bm.fork(parent, child)
    assert [src for src, _ in copies] == [parent.block_tables[0][4], parent.block_tables[1][4]]
    assert child.block_tables[1][:3] == parent.block_tables[1][:3] == [-1, -1, -1]
    assert child.block_tables[0][:4] == parent.block_tables[0][:4]
    bm.free(parent)
    bm.free(child)
    bm.check()
    assert bm.num_free_blocks == 32


def test_an_import_allocates_only_the_window_a_window_group_reads():
    bm = BlockManager(num_blocks=32, block_size=4, windows=(None, 6))
    s = seq(30)
    hit = bm.lookup(update_block_hashes(s, 4))
    assert bm.can_admit(s, hit, 30, importing=True)
    bm.admit(s, hit)
    bm.allocate(s, 30, importing=True)
    # the first query after the prompt (position 30) sees keys 25..30: window blocks 6 and 7
    assert len(s.block_tables[0]) == 8 and s.block_tables[1] == [-1] * 6 + s.block_tables[1][6:]
    assert bm.num_free_blocks == 32 - 8 - 2
    bm.free(s)
    bm.check()
