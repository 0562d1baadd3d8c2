"""Prefix caching in the engine: the same tokens and logprobs as without it, under chunked prefill, preemption with
evictions, n > 1, and disaggregated (hits on the prefill side, the decode side, both; the decode side reads only the
blocks it lacks)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine.core.engine import EngineConfig, LLMEngine
from raypd import LLM, DisaggregatedParams, SamplingParams
from tests.engine.test_engine import ARCH_VARIANTS, run
from tests.pools import wait_pools_full

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)


def conversation_arrivals(params: SamplingParams, seed: int = 0) -> dict:
    """Waves of prompts sharing a system prefix, exact repeats, and a conversation that grows turn by turn."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 4000) for _ in range(22)]
    suffix = lambda k: [rng.randrange(10, 4000) for _ in range(k)]  # noqa: E731
    turn1 = system + suffix(9)
    turn2 = turn1 + suffix(11)
    waves = [[turn1, system + suffix(5), system + suffix(14)], [turn2, turn1, system + suffix(3)],
             [turn2 + suffix(6), system + suffix(17), turn2]]
    arrivals, rid = {}, 0
    for step, wave in zip((0, 12, 30), waves):
        arrivals[step] = [(rid + i, p, params) for i, p in enumerate(wave)]
        rid += len(wave)
    return arrivals


def assert_same(on: dict, off: dict) -> None:
    assert on.keys() == off.keys()
    for rid in off:
        for k, (tokens, lps) in off[rid].items():
            assert on[rid][k][0] == tokens, f"request {rid} candidate {k}"
            for a, b in zip(on[rid][k][1], lps):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("arch", list(ARCH_VARIANTS))
@pytest.mark.parametrize("setting", ["chunked", "preempted"])
def test_caching_changes_no_token_or_logprob(model_factory, arch, setting):
    model_dir = model_factory(arch, **ARCH_VARIANTS[arch])
    extra = dict(max_num_batched_tokens=16) if setting == "chunked" else dict(num_blocks=20)
    if setting == "preempted" and arch == "mistral":  # its window (8) frees blocks behind it: a smaller pool
        extra = dict(num_blocks=8, max_num_batched_tokens=8)
    arrivals = conversation_arrivals(GREEDY)
    off = run(LLMEngine(model_dir, EngineConfig(block_size=4, enable_prefix_caching=False, **extra)), arrivals)
    engine = LLMEngine(model_dir, EngineConfig(block_size=4, **extra))
    assert_same(run(engine, arrivals), off)
    assert engine.scheduler.cache_stats.hit_tokens > 0
    if setting == "preempted":
        assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_evictions > 0
    engine.block_manager.check()


def test_caching_with_several_candidates(tiny_llama):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, n=3, ignore_eos=True, logprobs=1)
    arrivals = conversation_arrivals(params, seed=1)
    off = run(LLMEngine(tiny_llama, EngineConfig(block_size=4, enable_prefix_caching=False)), arrivals)
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4))
    assert_same(run(engine, arrivals), off)
    assert engine.scheduler.cache_stats.hit_tokens > 0


def test_the_result_reports_its_cached_tokens(tiny_llama):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks of 4
    with LLM(tiny_llama, block_size=4) as llm:
        first, again = llm.generate(prompt, params), llm.generate(prompt, params)
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 28
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        wait_pools_full(llm)


def test_a_cache_salt_keeps_tenants_apart(tiny_llama):
    prompt = list(range(200, 230))
    with LLM(tiny_llama, block_size=4) as llm:
        llm.generate(prompt, SamplingParams(max_tokens=2, cache_salt="tenant-a"))
        other = llm.generate(prompt, SamplingParams(max_tokens=2, cache_salt="tenant-b"))
        same = llm.generate(prompt, SamplingParams(max_tokens=2, cache_salt="tenant-a"))
        assert other.num_cached_tokens == 0 and same.num_cached_tokens == 28


@pytest.fixture(scope="module")
def pair(tiny_llama):
    with LLM(tiny_llama, block_size=4, kv_transfer="nixl") as ctx, LLM(tiny_llama, block_size=4, kv_transfer="nixl") as gen:
        yield ctx, gen


def _disaggregated(ctx: LLM, gen: LLM, prompt, params):
    c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    dp = c.disaggregated_params
    dp.request_type = "generation_only"
    return c, gen.generate(prompt, params, disaggregated_params=dp)


def _bytes_read(llm: LLM) -> int:
    return llm.engine.connector.stats().kv_bytes_read


@pytest.mark.parametrize("where", ["prefill", "decode", "both"])
def test_disaggregated_hits(pair, where):
    ctx, gen = pair
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [random.Random(where).randrange(10, 4000) for _ in range(30)]  # 7 full blocks + 2 tokens
    with LLM(ctx.model_dir, block_size=4, enable_prefix_caching=False) as reference:
        ref = reference.generate(prompt, params)
    for side in {"prefill": [ctx], "decode": [gen], "both": [ctx, gen]}[where]:
        side.generate(prompt, params)  # an earlier request leaves the prompt's blocks cached there
    before = _bytes_read(gen)
    c, g = _disaggregated(ctx, gen, prompt, params)
    assert g.outputs[0].token_ids == ref.outputs[0].token_ids
    assert c.num_cached_tokens == (28 if where in ("prefill", "both") else 0)
    block_bytes = gen.engine.kv_cache.layout.block_bytes
    read_blocks = 1 if where in ("decode", "both") else 8  # a decode-side hit leaves only the partial block to read
    assert _bytes_read(gen) - before == read_blocks * block_bytes
    wait_pools_full(ctx, gen)


def test_a_colocated_llm_never_loads_nixl(tiny_llama):
    script = ("import sys\nfrom raypd import LLM, SamplingParams\n"
              f"with LLM({tiny_llama!r}) as llm:\n"
              "    llm.generate('hello', SamplingParams(max_tokens=3))\n"
              "print(sorted(m for m in sys.modules if 'nixl' in m))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
