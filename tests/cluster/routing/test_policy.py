"""Routing decisions without Ray: the prefix summary, costs, the routers' ranking, local vs remote prefill, and the
SLO autoscaling policy on synthetic metrics."""

from __future__ import annotations

import asyncio
import os
import random
import time
from types import SimpleNamespace

import pytest

from cluster.planning.autoscaling import RolePolicy, desired_replicas
from cluster.serving.directory import Entry
from cluster.routing.local_prefill import LocalPrefill, OwnerLoad
from cluster.routing.request_router import LeastQueuedTokensRouter, PrefixAwareRouter
from cluster.routing.policy import (BITS_PER_KEY, EMPTY, PrefixSummary, ReplicaState, cached_tokens, choose_prefill,
                                    prompt_block_keys, replica_cost, replica_state)
from engine.core.engine import EngineConfig, LLMEngine
from llmapi.sampling_params import SamplingParams
from protocol import Submit

BS = 4


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


def _state(prompts: list[list[int]], load: int = 0, salt: str | None = None) -> ReplicaState:
    keys = b"".join(k for p in prompts for k in prompt_block_keys(p, BS, salt))
    return ReplicaState(load, BS, PrefixSummary.of(keys))


def test_summary_holds_every_key_and_few_others():
    keys = [os.urandom(16) for _ in range(3000)]
    summary = PrefixSummary.of(b"".join(keys))
    assert all(k in summary for k in keys)
    assert len(summary.bits) * 8 <= 2 * BITS_PER_KEY * len(keys)  # compact: at most 20 bits a key
    false_positives = sum(os.urandom(16) in summary for _ in range(20000))
    assert false_positives < 20000 * 0.02
    assert not any(k in EMPTY for k in keys[:100])
    with pytest.raises(ValueError, match="whole number"):
        PrefixSummary.of(b"x" * 17)


def test_router_keys_are_the_engines_own(tiny_llama):
    # A replica's summary is built from its block manager's keys; the router computes a prompt's keys itself.
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=BS, num_blocks=64))
    prompt = _tokens(22, seed=1)
    engine.add_request(0, prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    state = replica_state("prefill", engine.block_manager.cached_keys(), {"uncomputed_tokens": 0,
                                                                          "block_size": BS})
    extended = prompt + _tokens(10, seed=2)
    assert cached_tokens(state, prompt_block_keys(extended, BS), len(extended)) == 20  # its 5 full blocks
    assert cached_tokens(state, prompt_block_keys(extended, BS, "tenant"), len(extended)) == 0  # salted: no hit
    other = _tokens(32, seed=3)
    assert cached_tokens(state, prompt_block_keys(other, BS), len(other)) == 0


def test_a_hit_leaves_the_last_token_to_compute():
    prompt = _tokens(8, seed=4)  # exactly two blocks
    state = _state([prompt])
    assert cached_tokens(state, prompt_block_keys(prompt, BS), len(prompt)) == 4
    assert cached_tokens(state, prompt_block_keys(prompt + [7], BS), 9) == 8


def test_cost_weighs_the_hit_against_the_load():
    history = _tokens(200, seed=5)
    prompt = history + _tokens(20, seed=6)
    keys = prompt_block_keys(prompt, BS)
    holder, idle = _state([history], load=100), _state([], load=0)
    assert replica_cost(holder, keys, len(prompt)) == 20 + 100
    assert replica_cost(idle, keys, len(prompt)) == 220
    busy_holder = _state([history], load=500)
    assert replica_cost(busy_holder, keys, len(prompt)) > replica_cost(idle, keys, len(prompt))
    assert replica_cost(idle, keys, len(prompt), pending_keys=frozenset(keys)) == 220 - 216


def test_state_round_trips_and_garbage_is_refused():
    state = _state([_tokens(40, seed=7)], load=33)
    assert ReplicaState.from_stats(state.to_stats()) == state
    assert ReplicaState.from_json(state.to_json()) == state
    for bad in (None, {}, {"queued_tokens": 4}, {"load_tokens": 1, "block_size": 4, "prefix_summary": b"abc"},
                {"load_tokens": "x", "block_size": 4, "prefix_summary": EMPTY.bits}):
        assert ReplicaState.from_stats(bad) is None
    assert ReplicaState.from_json({"load_tokens": 1, "block_size": 4, "prefix_summary": "%%%"}) is None


def test_decode_load_counts_kv_in_use_and_tokens_to_generate():
    load = {"uncomputed_tokens": 7, "queued_tokens": 50, "kv_blocks_in_use": 3, "block_size": BS}
    assert replica_state("prefill", b"", load).load_tokens == 7
    assert replica_state("decode", b"", load).load_tokens == 50 + 3 * BS


def test_conditional_disaggregation_prefills_short_remainders_locally():
    history = _tokens(120, seed=8)
    decode = [_state([history]), _state([])]
    follow_up = history + _tokens(10, seed=9)
    assert choose_prefill(_tokens(20, seed=10), None, decode, 32).local  # short prompt
    assert not choose_prefill(_tokens(100, seed=11), None, decode, 32).local  # long, nothing cached
    choice = choose_prefill(follow_up, None, decode, 32)  # long, but a decode replica holds all but the new turn
    assert choice.local and choice.tokens_to_prefill == 130 - 120
    assert not choose_prefill(follow_up, "other-tenant", decode, 32).local  # the salt keys it apart
    assert not choose_prefill(_tokens(5, seed=12), None, decode, 0).local  # 0: never local
    assert choose_prefill(_tokens(5, seed=12), None, [], 32).local  # no view yet: the whole prompt is weighed


BUSY = OwnerLoad(serving=3, prefill_backlog_tokens=0)  # other requests in flight, none waiting at prefill


def test_local_prefill_decides_from_the_decode_entries_the_watch_hands_it():
    history = _tokens(120, seed=8)
    follow_up = SimpleNamespace(prompt_token_ids=history + _tokens(10, seed=9), sampling_params=SamplingParams())
    local = LocalPrefill(32)
    assert not local(follow_up, BUSY)  # no view yet: all 130 tokens are weighed
    entries = [Entry("decode", "a", None, {}, 1, (), _state([history]).to_json()),
               Entry("decode", "b", None, {}, 1, (), None)]  # not reporting a routing state: skipped
    local.update(entries)
    assert local(follow_up, BUSY) and local.choose(follow_up, BUSY).tokens_to_prefill == 10
    local.update([])  # the replica is gone: the next view has nothing cached
    assert not local(follow_up, BUSY)


def test_a_backed_up_prefill_role_sends_new_prompts_to_their_decode_replica():
    prompt = SimpleNamespace(prompt_token_ids=_tokens(100, seed=13), sampling_params=SamplingParams())
    by_load = LocalPrefill(0, max_prefill_backlog_tokens=512)
    assert not by_load(prompt, OwnerLoad(3, 511))  # under the threshold: remote
    choice = by_load.choose(prompt, OwnerLoad(3, 512))
    assert choice.local and choice.tokens_to_prefill == 100
    both = LocalPrefill(32, max_prefill_backlog_tokens=512)
    short = SimpleNamespace(prompt_token_ids=_tokens(10, seed=14), sampling_params=SamplingParams())
    assert both(short, BUSY) and not both(prompt, BUSY)  # the length rule still decides with nothing waiting
    assert not LocalPrefill(32)(prompt, OwnerLoad(3, 10_000))  # 0: the backlog never decides
    assert not by_load(prompt, OwnerLoad(0, 0))  # idle, but the idle rule is off


def test_a_prompt_arriving_at_an_idle_owner_prefills_on_its_decode_replica():
    prompt = SimpleNamespace(prompt_token_ids=_tokens(100, seed=15), sampling_params=SamplingParams())
    idle = LocalPrefill(0, when_idle=True)
    choice = idle.choose(prompt, OwnerLoad(0, 0))
    assert choice.local and choice.tokens_to_prefill == 100
    assert not idle(prompt, OwnerLoad(1, 0))  # one other request, decoding: remote, it does not stall that one
    assert not idle(prompt, OwnerLoad(1, 100))  # one other waiting at prefill: remote too


def test_each_rule_turns_conditional_disaggregation_on_by_itself():
    def config(local: int, backlog: int, idle: bool = False):
        router = SimpleNamespace(max_local_prefill_tokens=local, max_prefill_backlog_tokens=backlog,
                                 local_prefill_when_idle=idle)
        return SimpleNamespace(router=router)

    assert LocalPrefill.for_config(config(0, 0), colocated=False) is None
    assert LocalPrefill.for_config(config(0, 2048), colocated=False).max_prefill_backlog_tokens == 2048
    assert LocalPrefill.for_config(config(0, 0, idle=True), colocated=False).when_idle
    assert LocalPrefill.for_config(config(0, 2048), colocated=True) is None  # colocated: everything is local


def _replica(name: str, stats: dict | None):
    return SimpleNamespace(replica_id=name, routing_stats=stats)


def _request(ids: list[int], salt: str | None = None, internal_id: str | None = None):
    return SimpleNamespace(args=(Submit(7, ids, SamplingParams(cache_salt=salt)),),
                           metadata=SimpleNamespace(internal_request_id=internal_id or str(random.random())))


def _route(router, replicas, request) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    assert all(len(rank) == 1 for rank in ranks)  # one per rank: Serve keeps the order
    return [rank[0].replica_id for rank in ranks]


def test_prefix_aware_router_follows_the_cache_until_the_load_outweighs_it():
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)  # the ranking needs none of Serve's state
    router.initialize_state()
    history = _tokens(200, seed=13)
    holder = _replica("a", _state([history], load=50).to_stats())
    idle = _replica("b", _state([], load=0).to_stats())
    assert _route(router, [idle, holder], _request(history + _tokens(8, seed=14))) == ["a", "b"]
    holder.routing_stats = _state([history], load=5000).to_stats()  # a fresh report: now swamped
    assert _route(router, [idle, holder], _request(history + _tokens(8, seed=15))) == ["b", "a"]


def test_prefix_aware_router_keeps_a_burst_together_before_any_report():
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    a, b = _replica("a", _state([]).to_stats()), _replica("b", _state([]).to_stats())
    first = _tokens(300, seed=16)
    chosen = _route(router, [a, b], _request(first))[0]
    # the follow-up shares 300 tokens with what was just sent there: 300 in flight + 8 there against 308 elsewhere,
    # and the tie goes to the replica that computes less
    follow = first + _tokens(8, seed=17)
    assert _route(router, [a, b], _request(follow))[0] == chosen
    # an unrelated prompt goes to the other, less loaded replica
    assert _route(router, [a, b], _request(_tokens(50, seed=18)))[0] != chosen


def test_a_sent_prompt_counts_as_cached_there_until_a_report_shows_it(monkeypatch):
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    a, b = _replica("a", _state([]).to_stats()), _replica("b", _state([]).to_stats())
    first = _tokens(300, seed=23)
    chosen = _route(router, [a, b], _request(first, internal_id="f"))[0]
    router.on_request_completed(chosen, "f")
    clock = time.monotonic() + 10  # the reports lag (Serve's controller on a busy machine): both still empty
    monkeypatch.setattr("cluster.routing.request_router.time.monotonic", lambda: clock)
    follow = first + _tokens(8, seed=24)
    assert _route(router, [a, b], _request(follow, internal_id="g"))[0] == chosen
    router.on_request_completed(chosen, "g")
    # a report that shows the blocks takes over from the router's memory of them
    holder = a if chosen == "a" else b
    holder.routing_stats = _state([first]).to_stats()
    assert _route(router, [a, b], _request(first + _tokens(8, seed=25)))[0] == chosen
    assert all(when == clock for when, _, _ in router._sent_keys[chosen])  # the first prompt's entry is let go


def test_in_flight_tokens_count_until_the_request_completes():
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    a, b = _replica("a", _state([]).to_stats()), _replica("b", _state([]).to_stats())
    first = _request(_tokens(100, seed=20), internal_id="r1")
    chosen = _route(router, [a, b], first)[0]
    assert _route(router, [a, b], _request(_tokens(60, seed=21)))[0] != chosen  # 100 in flight there
    router.on_request_completed(chosen, "r1")
    others = [_route(router, [a, b], _request(_tokens(60, seed=22 + i)))[0] for i in range(2)]
    assert chosen in others  # with r1 done, chosen is free again


def test_a_replica_that_has_not_reported_is_weighed_by_what_was_sent_to_it():
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    new, old = _replica("new", None), _replica("old", _state([], load=400).to_stats())
    assert _route(router, [old, new], _request(_tokens(40, seed=19))) == ["new", "old"]


def test_least_queued_tokens_router_ranks_by_reported_and_sent_tokens():
    router = LeastQueuedTokensRouter.__new__(LeastQueuedTokensRouter)
    router.initialize_state()
    busy = _replica("a", {"queued_tokens": 900})
    idle = _replica("b", {"queued_tokens": 100})
    request = SimpleNamespace(args=(Submit(7, list(range(1000)), SamplingParams()),))
    assert _route(router, [busy, idle], request) == ["b", "a"]
    # the 1000 prompt tokens just sent count against b until b reports again
    assert _route(router, [busy, idle], request) == ["a", "b"]
    idle.routing_stats = {"queued_tokens": 50}
    assert _route(router, [busy, idle], None) == ["b", "a"]


def test_slo_policy_scales_on_the_worst_signal_against_its_target():
    metrics = {"running_seqs": {"r1": 48.0, "r2": 40.0}, "kv_usage": {"r1": 0.5, "r2": 0.3},
               "tpot_ms": {"r1": 30.0, "r2": 50.0}}
    want, ratios = desired_replicas(2, metrics, {"running_seqs": 32, "kv_usage": 0.8, "tpot_ms": 50})
    assert ratios == pytest.approx({"running_seqs": 44 / 32, "kv_usage": 0.5, "tpot_ms": 0.8})
    assert want == pytest.approx(2 * 44 / 32)
    calm = {"queued_prompt_tokens": {"r1": 100.0, "r2": 0.0, "r3": 50.0}, "ttft_ms": {"r1": 20.0}}
    assert desired_replicas(3, calm, {"queued_prompt_tokens": 1000, "ttft_ms": 200})[0] == pytest.approx(0.3)
    assert desired_replicas(2, {}, {"ttft_ms": 100}) == (2.0, {})  # nothing reported yet: stay


def test_slo_policy_as_serve_calls_it():
    policy = RolePolicy(targets={"queued_prompt_tokens": 512})
    ctx = SimpleNamespace(current_num_replicas=1, target_num_replicas=1,
                          aggregated_metrics={"queued_prompt_tokens": {"r1": 2048.0}})
    want, state = policy(ctx)
    assert want == 4 and state["raypd_ratios"] == {"queued_prompt_tokens": 4.0}
    cold = SimpleNamespace(current_num_replicas=0, target_num_replicas=1, aggregated_metrics={})
    assert policy(cold)[0] == 1
