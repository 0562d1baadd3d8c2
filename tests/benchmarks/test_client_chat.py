"""raypd bench's multi-turn chat workload against the stand-in OpenAI server of test_bench_client."""

from __future__ import annotations

import pytest

from benchmarks.client import BenchResult, RequestRecord, run_benchmark
from benchmarks.workload import BenchConfig, make_workload, system_prompt

from tests.benchmarks.test_client import MODEL, _config, endpoint, server  # noqa: F401 (fixtures)

REPLY = "".join(f" t{i}" for i in range(6))  # what the stand-in server streams for output_len 6


def test_each_turn_is_the_conversation_so_far_plus_a_new_message(server):  # noqa: F811
    url, state = server
    config = _config(url, workload="chat", num_requests=9, num_turns=3, system_len=12, request_rate=50.0)
    result = run_benchmark(config)
    assert result.completed == 9 and len(state.bodies) == 9
    system = system_prompt(config)
    assert len(system.split()) == 12
    prompts = [b["prompt"] for b in state.bodies]
    firsts = [p for p in prompts if REPLY not in p]
    assert len(firsts) == 3 and all(p.startswith(system + " ") for p in firsts)
    for first in firsts:
        turns = sorted((p for p in prompts if p.startswith(first)), key=len)
        assert len(turns) == 3
        for before, after in zip(turns, turns[1:]):
            # the server's reply, then the next user message of input_len words
            assert after.startswith(before + REPLY + " ")
            assert len(after[len(before + REPLY):].split()) == config.input_len
    assert state.peak <= 3  # one turn in flight per conversation


def test_chat_workload_is_seeded_and_conversations_arrive_as_the_poisson_process():
    config = BenchConfig("http://127.0.0.1:1/v1", MODEL, num_requests=400, request_rate=10.0, workload="chat",
                         num_turns=4)
    specs = make_workload(config)
    assert [(s.conversation, s.turn) for s in specs[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    starts = [s.arrival_s for s in specs if s.turn == 0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 10.0, rel=0.2)
    assert [s.prompt for s in make_workload(config)] == [s.prompt for s in specs]


@pytest.mark.parametrize("change, field", [({"num_turns": 3}, "num_turns"), ({"workload": "poems"}, "workload"),
                                           ({"system_len": -1}, "system_len")])
def test_bad_chat_settings_are_named(change, field):
    with pytest.raises(ValueError, match=f"bench {field}"):
        BenchConfig("http://127.0.0.1:1/v1", MODEL, num_requests=8, **{"workload": "chat", **change})


def test_cache_hit_rate_is_the_share_of_prompt_tokens_reported_cached():
    records = [RequestRecord(1, 1, ok=True, prompt_tokens=100, cached_tokens=80),
               RequestRecord(1, 1, ok=True, prompt_tokens=300, cached_tokens=0),
               RequestRecord(1, 1, ok=False, prompt_tokens=1000, cached_tokens=1000)]
    config = BenchConfig("http://127.0.0.1:1/v1", MODEL)
    assert BenchResult(config, 1.0, records).cache_hit_rate == pytest.approx(80 / 400)
    assert BenchResult(config, 1.0, [RequestRecord(1, 1, ok=True)]).cache_hit_rate is None
