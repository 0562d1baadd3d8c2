"""Block manager and scheduler, without a model: tables, reference counts, budgets, preemption."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import EngineRequest, Sequence, SeqStatus
from engine.scheduler import Scheduler
from llmapi import SamplingParams


def seq(num_tokens: int, seq_id: int = 0) -> Sequence:
    req = EngineRequest(seq_id, list(range(num_tokens)), SamplingParams())
    s = Sequence(seq_id, req, 0, list(range(num_tokens)))
    req.seqs.append(s)
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


def test_scheduler_budget_chunks_prompts_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=10, max_num_seqs=8)
    a, b = seq(7, 0), seq(7, 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 7), (1, 3)]
    a.num_computed_tokens, b.num_computed_tokens = 7, 3
    a.token_ids.append(99)  # a sampled its first token
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 4)]


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    sched = Scheduler(BlockManager(4, 4), max_num_batched_tokens=100, max_num_seqs=8)
    old, new = seq(8, 0), seq(8, 1)
    sched.add(old)
    sched.add(new)
    sched.schedule()
    old.num_computed_tokens = new.num_computed_tokens = 8
    old.token_ids.append(1)
    new.token_ids.append(1)
    out = sched.schedule()  # old needs a third block; only new can give it up
    assert out.preempted == [new] and [s for s, _ in out.scheduled] == [old]
    assert new.status is SeqStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sched.num_preemptions == 1


def test_scheduler_caps_running_sequences():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add(seq(2, i))
    assert len(sched.schedule().scheduled) == 2 and len(sched.waiting) == 1
