"""Prefill and decode as Ray actors on two Ray nodes, KV over NIXL between them, one owner in the test process."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.owner.client import DisaggregatedClient
from cluster.serving.launch import start_workers
from engine.core.engine import EngineConfig
from raypd import LLM, SamplingParams

PROMPTS = ["The history of the", "café 你好 🙂 naïve", "one two three four five six seven eight nine ten"]
CONFIG = EngineConfig(block_size=4, num_threads=1)


@pytest.fixture(scope="module")
def workers(ray_cluster, tiny_llama):
    w = start_workers(tiny_llama, CONFIG)
    yield w
    w.kill()


@pytest.fixture(scope="module")
def client(workers, tiny_llama):
    with DisaggregatedClient(workers.prefill, workers.decode, tiny_llama, request_timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    with LLM(tiny_llama, block_size=4) as llm:
        yield llm


def pools_full(actors, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    blocks = []
    while time.monotonic() < deadline:
        blocks = ray.get([a.kv_blocks.remote() for a in actors], timeout=30)
        if all(free == total for free, total in blocks):
            return
        time.sleep(0.05)
    raise AssertionError(f"KV pools not back to full (free, total): {blocks}")


def test_actors_land_on_the_nodes_with_their_resources(workers):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}

    for actor, role in [(workers.prefill[0], "prefill"), (workers.decode[0], "decode")]:
        node = ray.get(actor.node_id.remote(), timeout=30)
        assert role in nodes[node], f"{role} actor on a node without the {role} resource"
    assert ray.get(workers.prefill[0].node_id.remote()) != ray.get(workers.decode[0].node_id.remote())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=21, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=4, ignore_eos=True),
], ids=["greedy", "seeded", "n2"])
def test_same_tokens_as_colocated(client, colocated, workers, params):
    got = client.generate(PROMPTS, params, use_tqdm=False, timeout=60)
    ref = colocated.generate(PROMPTS, params, use_tqdm=False)
    for g, r in zip(got, ref):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in r.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in r.outputs]
        assert [o.finish_reason for o in g.outputs] == ["length"] * params.n
    pools_full(workers.prefill + workers.decode)


def test_first_token_streams_before_decoding(client):
    result = client.generate_async("stream the first token", SamplingParams(max_tokens=20, temperature=0,
                                                                           ignore_eos=True), streaming=True)
    first = next(iter(result))
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    result.result(timeout=60)
    assert len(result.outputs[0].token_ids) == 20


def test_abort_frees_both_sides(client, workers):
    result = client.generate_async("abort me", SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True),
                                   streaming=True)
    next(iter(result))
    time.sleep(0.2)
    result.abort()
    result.result(timeout=30)
    assert result.outputs[0].finish_reason == "cancelled"
    pools_full(workers.prefill + workers.decode)


def test_a_request_that_ends_at_prefill_frees_the_prefill_blocks_at_once(client, workers):
    out = client.generate("one token only", SamplingParams(max_tokens=1, temperature=0), timeout=60)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    pools_full(workers.prefill, timeout=5.0)  # well before the 30 s lease would end
