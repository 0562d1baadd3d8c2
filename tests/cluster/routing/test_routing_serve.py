"""Routing on a real Serve application: prefix-aware routing across two prefill replicas, conditional
disaggregation (short prompts, and prompts arriving while the prefill role is backed up, prefill on the decode
replica, without a KV transfer), and the SLO autoscaling policy scaling a role on its own signal."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from ray import serve

from cluster.serving.app import build_from_config
from cluster.config import parse_config
from cluster.serving.directory import Directory
from raypd import LLM, SamplingParams

APP, SCALE_APP = "raypd-route", "raypd-scale"
BLOCK = 4
LOCAL_BELOW = 24  # router.max_local_prefill_tokens
MAX_TOKENS = 8


def _config(model: str, port: int, **changes):
    role = {"replicas": 1, "num_cpus": 0}
    return parse_config({
        "model": model, "served_model_name": "tiny", "dtype": "float32",  # token-exact against the embedded LLM
        "engine": {"block_size": BLOCK, "num_threads": 1, "kv_cache_bytes": "64MiB"},
        "prefill": {**role, "replicas": 2}, "decode": role, "postproc": {**role, "replicas": 2}, "ingress": role,
        "router": {"policy": "prefix_aware", "max_local_prefill_tokens": LOCAL_BELOW},
        "http": {"host": "127.0.0.1", "port": port}, **changes,
    })


@pytest.fixture(scope="module")
def server(serve_port, postprocs, tiny_llama):
    """The module's applications are deleted by serve_port when it ends."""
    postprocs.serving(tiny_llama)
    serve.run(build_from_config(_config(tiny_llama, serve_port)), name=APP, route_prefix="/route")
    return serve_port


@pytest.fixture(scope="module")
def scaling(server, tiny_llama):
    """A second application, least_queued_tokens over Ray actor calls (router.transport: ray; the module's other app
    uses the default, gRPC), whose prefill role autoscales on a TTFT target far below any real prefill: once a
    replica reports TTFT samples, the policy wants the maximum, 2. A prompt arriving while one of its ingress's waits
    at prefill is prefilled on its decode replica (max_prefill_backlog_tokens 1). Two tests share it (an application
    takes ~12 s to deploy here): the first scales it, the second sends a burst."""
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "look_back_period_s": 20,
                   "slo": {"ttft_ms": 0.001}}
    config = _config(tiny_llama, server, prefill={"num_cpus": 0, "autoscaling": autoscaling},
                     router={"policy": "least_queued_tokens", "transport": "ray", "max_prefill_backlog_tokens": 1})
    serve.run(build_from_config(config), name=SCALE_APP, route_prefix="/scale")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/scale/v1", api_key="unused", timeout=60,
                         max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/route/v1", api_key="unused", timeout=60,
                         max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(tiny_llama, block_size=BLOCK) as llm:
        yield llm


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _complete(client, prompt: list[int]) -> str:
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    return got.choices[0].text


def _expected(reference, prompt: list[int]) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return reference.generate(prompt, params).outputs[0].text


def _kv_bytes_read() -> int:
    decode = serve.get_deployment_handle("decode", app_name=APP)
    return int(decode.stats.remote().result(timeout_s=30)["kv_bytes_read"])


def _prefill_totals(until=lambda totals: True, timeout_s: float = 10.0) -> dict[str, float]:
    """The prefill role's stats summed over its replicas, from the directory (refreshed every second)."""
    directory, deadline = Directory(APP), time.monotonic() + timeout_s
    while True:
        totals = directory.totals("prefill")
        if totals.get("replicas") == 2 and until(totals):
            return totals
        assert time.monotonic() < deadline, f"prefill stats never got there: {totals}"
        time.sleep(0.2)


def _settle() -> None:
    """Lets every replica's routing report and directory entry catch up (0.5 s and 1 s periods)."""
    time.sleep(2.5)


def test_prefix_aware_routing_sends_each_follow_up_to_the_replica_holding_its_prefix(client):
    firsts = [_tokens(64, seed=100 + i) for i in range(4)]
    before = _prefill_totals()
    with ThreadPoolExecutor(len(firsts)) as pool:  # at once: in flight together, they spread over both replicas
        list(pool.map(lambda p: _complete(client, p), firsts))
    _settle()
    # 32 new tokens: more than max_local_prefill_tokens left after the decode replica's hit, so prefilled remotely.
    # In the reverse order (a load-only policy sends them wherever it sent the first turns' opposites); each after
    # the replicas have reported being idle again, so the load in their reports is 0 and only the cache decides.
    for i, prompt in reversed(list(enumerate(firsts))):
        _complete(client, prompt + _tokens(32, seed=200 + i))
        time.sleep(1.0)
    queried = 4 * 64 + 4 * 96
    totals = _prefill_totals(lambda t: t["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"] >= queried)
    hits = totals["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    # every follow-up found its whole first turn (16 blocks) on the replica it went to; scattered, half would miss
    assert hits == 4 * 64


def test_short_prompts_prefill_on_the_decode_replica_without_a_kv_transfer(client, reference):
    _settle()
    short = _tokens(LOCAL_BELOW - 4, seed=300)
    read, queried = _kv_bytes_read(), _prefill_totals()["prefix_cache_query_tokens"]
    assert _complete(client, short) == _expected(reference, short)
    _settle()
    assert _kv_bytes_read() == read, "a short prompt's KV was transferred"
    assert _prefill_totals()["prefix_cache_query_tokens"] == queried, "a short prompt reached a prefill replica"

    long = _tokens(80, seed=301)
    assert _complete(client, long) == _expected(reference, long)
    assert _kv_bytes_read() > read, "a long prompt was not transferred"
    _prefill_totals(lambda t: t["prefix_cache_query_tokens"] == queried + len(long))

    # the next turn of the long one: the decode replica holds all but its new tokens, so it prefills there
    _settle()
    read = _kv_bytes_read()
    follow = long + _tokens(6, seed=302)
    assert _complete(client, follow) == _expected(reference, follow)
    _settle()
    assert _kv_bytes_read() == read
    assert _prefill_totals()["prefix_cache_query_tokens"] == queried + len(long)


def test_slo_policy_scales_prefill_on_its_ttft(server, scaling):
    # Ongoing requests are 0 once the prompts are done, so Serve's default policy would not scale. One at a time, no
    # prompt arrives while another waits at prefill: each is prefilled there and gives a TTFT sample.
    for i in range(4):
        _complete(scaling, _tokens(40, seed=400 + i))
    deadline = time.monotonic() + 120
    while serve.status().applications[SCALE_APP].deployments["prefill"].replica_states.get("RUNNING", 0) < 2:
        assert time.monotonic() < deadline, "prefill did not scale up on its TTFT"
        time.sleep(1.0)
    assert serve.status().applications[SCALE_APP].deployments["decode"].replica_states.get("RUNNING") == 1
    assert _local_prefills(server) == 0


def _local_prefills(port: int) -> float:
    """The scaling app's ingress's count of prompts it prefilled on their decode replica."""
    metrics = httpx.get(f"http://127.0.0.1:{port}/scale/metrics", timeout=10).text
    line = next((line for line in metrics.splitlines() if 'role="ingress",what="local_prefill"' in line), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_batch_of_prompts_is_routed_call_by_call(client, reference):
    # The prompts of one HTTP request are in flight at once, each its own prefill and decode call: the router's
    # choice must reach each call (they share the HTTP request's context), or one waits for a replica forever.
    words = [chr(97 + i) * 3 for i in range(26)]
    prompts = [" ".join(random.Random(500 + i).choices(words, k=40)) for i in range(3)]
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}, timeout=30)
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [_expected(reference, p) for p in prompts]


def test_prompts_arriving_while_others_wait_at_prefill_prefill_on_the_decode_replica(server, scaling, reference):
    # A threshold of one token: while any prompt of this ingress waits at a prefill replica, a new one is prefilled
    # on its decode replica. A batch's prompts start one after another on the owner's loop, so the first goes to
    # prefill and the rest, arriving while it waits there, are served whole on decode (after the test above, with a
    # second prefill replica idle).
    before = _local_prefills(server)
    prompts = [_tokens(40, seed=600 + i) for i in range(4)]
    got = scaling.completions.create(model="tiny", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}, timeout=60)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [_expected(reference, p) for p in prompts]
    assert _local_prefills(server) - before == 3
