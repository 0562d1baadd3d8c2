"""Scheduler without a model: budgets, preemption, prefix-cache admission and the waiting-for-KV queue.

The KV connector here is a recording implementation of engine.kv.kv_connector.KVConnector: these tests are about which
queue a sequence is in, not about moving KV (tests/engine/test_disagg.py does that over real NIXL)."""

from __future__ import annotations

from engine.kv.block_hash import update_block_hashes
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import KVLayout
from engine.kv.kv_connector import ConnectorEvents, ImportPlan, NullConnector
from engine.kv.kv_handle import KVHandle
from engine.core.request import EngineRequest, MultimodalItem, Sequence, SeqStatus
from engine.core.scheduler import Scheduler
from llmapi import SamplingParams


def seq(num_tokens: int, seq_id: int = 0, tokens: list[int] | None = None, n: int = 1) -> Sequence:
    tokens = list(range(num_tokens)) if tokens is None else tokens
    req = EngineRequest(seq_id, list(tokens), SamplingParams(n=n))
    s = Sequence(seq_id, req, 0, list(tokens))
    req.seqs.append(s)
    return s


class RecordingConnector(NullConnector):
    """Starts no transfer: records what the scheduler asks for and reports what the test says happened."""

    def __init__(self):
        self.started: list[ImportPlan] = []
        self.cancelled: list[Sequence] = []

    def start_import(self, plan: ImportPlan) -> None:
        self.started.append(plan)

    def cancel_import(self, seq: Sequence) -> None:
        self.cancelled.append(seq)


def importing(num_tokens: int, seq_id: int, n: int = 1) -> Sequence:
    s = seq(num_tokens, seq_id, n=n)
    layout = KVLayout(1, 1, 4, 4, "float32")
    blocks = tuple(range(100, 100 + -(-num_tokens // 4)))
    s.request.kind = "generation_only"
    s.request.kv_source = KVHandle(seq_id, "prefill-0", b"", blocks, (1,) * len(blocks), num_tokens, layout, "f",
                                   0.0)
    return s


def scheduler(num_blocks: int = 64, budget: int = 100, max_seqs: int = 8, connector=None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), connector or NullConnector(), budget, max_seqs)


def computed(sched: Scheduler, out) -> None:
    sched.on_computed(out)
    sched.block_manager.check()


def test_budget_chunks_prompts_fcfs():
    sched = scheduler(budget=10)
    a, b = seq(7, 0), seq(7, 1, tokens=list(range(50, 57)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 7), (1, 3)]
    computed(sched, out)
    a.token_ids.append(99)  # a sampled its first token
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 4)]


def test_preempts_the_newest_when_blocks_run_out():
    sched = scheduler(num_blocks=4)
    old, new = seq(8, 0), seq(8, 1, tokens=list(range(50, 58)))
    sched.add(old)
    sched.add(new)
    computed(sched, sched.schedule())
    old.token_ids.append(1)
    new.token_ids.append(1)
    out = sched.schedule()  # old needs a third block; only new can give it up
    assert out.preempted == [new] and [s for s, _ in out.scheduled] == [old]
    assert new.status is SeqStatus.WAITING and new.num_computed_tokens == 0 and new.block_tables == []
    assert sched.num_preemptions == 1
    sched.block_manager.check()


def test_caps_running_sequences():
    sched = scheduler(max_seqs=2)
    for i in range(3):
        sched.add(seq(2, i, tokens=[i, i]))
    assert len(sched.schedule().scheduled) == 2 and len(sched.waiting) == 1


def test_a_request_reserves_a_seat_per_candidate():
    sched = scheduler(max_seqs=4)
    sched.add(seq(3, 0, n=3))
    sched.add(seq(3, 1, tokens=[7, 8, 9], n=2))
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [0]  # 3 + 2 seats > 4


def test_a_repeated_prompt_computes_only_its_uncached_suffix():
    sched = scheduler()
    first = seq(10, 0)
    sched.add(first)
    computed(sched, sched.schedule())
    sched.finish(first)
    again = seq(10, 1)
    sched.add(again)
    out = sched.schedule()
    assert out.scheduled == [(again, 2)] and again.num_computed_tokens == 8 and again.request.num_cached_tokens == 8
    aligned = seq(8, 2)  # every block cached: the last one is still computed, its logits are needed
    sched.add(aligned)
    assert sched.schedule().scheduled[-1] == (aligned, 4)
    assert sched.cache_stats.hit_tokens == 8 + 4 and sched.cache_stats.query_tokens == 10 + 10 + 8


def test_a_preempted_sequence_finds_its_blocks_again():
    sched = scheduler(num_blocks=5)
    old, new = seq(8, 0), seq(8, 1, tokens=list(range(50, 58)))
    sched.add(old)
    sched.add(new)
    computed(sched, sched.schedule())
    old.token_ids.append(1)
    new.token_ids.append(1)
    out = sched.schedule()  # old takes the last free block; new must give its two back
    assert out.preempted == [new] and sched.block_manager.num_cached_blocks == 4
    computed(sched, out)
    sched.finish(old)
    out = sched.schedule()
    assert out.scheduled == [(new, 1)] and new.num_computed_tokens == 8  # its 8 tokens came from the cache
    assert new.request.num_cached_tokens == 0  # what the first admission found


def test_imports_wait_for_blocks_and_seats_in_their_queue():
    connector = RecordingConnector()
    sched = scheduler(num_blocks=6, max_seqs=2, connector=connector)
    a, b, c = importing(8, 0), importing(8, 1), importing(8, 2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert out.scheduled == [] and sched.waiting_for_kv == [a, b] and list(sched.waiting) == [c]
    assert [p.seq for p in connector.started] == [a, b] and connector.started[0].remote_blocks == (100, 101)
    assert len(sched.running) + len(sched.waiting_for_kv) <= 2
    arrived, failed = sched.update_from_connector(ConnectorEvents(imports_done=((a, None),)))
    assert arrived == [a] and failed == [] and sched.running == [a] and a.num_computed_tokens == 8
    sched.schedule()
    assert list(sched.waiting) == [c]  # a and b still take both seats
    sched.finish(a)
    sched.schedule()
    assert sched.waiting_for_kv == [b, c]


def test_an_import_that_fails_prefills_here():
    sched = scheduler(connector=RecordingConnector())
    a = importing(8, 0)
    sched.add(a)
    sched.schedule()
    sched.update_from_connector(ConnectorEvents(imports_done=((a, "the lease ended"),)))
    assert list(sched.waiting) == [a] and a.block_tables == [] and a.request.kv_source is None
    a.token_ids.append(5)  # its first token, from the prefill side
    assert sched.schedule().scheduled == [(a, 9)]


def test_an_import_of_images_that_fails_ends_the_request_instead():
    # A generation-only request of a prompt with images has no embeddings here: it cannot prefill locally.
    sched = scheduler(connector=RecordingConnector())
    a = importing(8, 0)
    a.request.mm_items = (MultimodalItem((1,) * 8, 2, 4),)
    sched.add(a)
    sched.schedule()
    started, failed = sched.update_from_connector(ConnectorEvents(imports_done=((a, "the lease ended"),)))
    assert started == [] and [s for s, _ in failed] == [a] and "the lease ended" in failed[0][1]
    assert a.finished and a.block_tables == [] and not sched.waiting and not sched.waiting_for_kv
    sched.block_manager.check()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_an_import_is_preempted_before_a_running_sequence():
    connector = RecordingConnector()
    sched = scheduler(num_blocks=4, connector=connector)
    runner = seq(8, 0, tokens=list(range(50, 58)))
    sched.add(runner)
    computed(sched, sched.schedule())
    reader = importing(8, 1)
    sched.add(reader)
    sched.schedule()
    assert sched.waiting_for_kv == [reader]
    runner.token_ids.append(1)
    out = sched.schedule()  # the runner needs a block: the import gives its back, its read is cancelled
    assert out.preempted == [reader] and connector.cancelled == [reader] and list(sched.waiting) == [reader]
    assert reader.block_tables == [] and reader.request.kv_source is not None
    sched.block_manager.check()


def test_a_decode_side_hit_reads_only_the_missing_blocks():
    connector = RecordingConnector()
    sched = scheduler(connector=connector)
    earlier = seq(10, 0)
    sched.add(earlier)
    computed(sched, sched.schedule())
    sched.finish(earlier)
    reader = importing(10, 1)
    sched.add(reader)
    sched.schedule()
    plan = connector.started[0]
    assert plan.remote_blocks == (102,) and len(plan.local_blocks) == 1 and reader.num_computed_tokens == 8


def test_held_blocks_are_freed_when_the_lease_ends():
    sched = scheduler()
    s = seq(8)
    sched.add(s)
    computed(sched, sched.schedule())
    sched.hold(s)
    assert s.finished and sched.block_manager.num_free_blocks == 62
    sched.update_from_connector(ConnectorEvents(leases_ended=(0,)))
    sched.update_from_connector(ConnectorEvents(leases_ended=(0,)))  # idempotent
    assert sched.block_manager.num_free_blocks == 64
    sched.block_manager.check()


def test_block_hashes_follow_the_tokens():
    s = seq(9)
    assert len(update_block_hashes(s, 4)) == 2
    s.token_ids.extend([1, 2, 3])
    assert len(update_block_hashes(s, 4)) == 3
