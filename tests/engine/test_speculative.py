"""Speculative decoding (n-gram drafts): the same tokens and logprobs as without it, every family, under chunked
prefill, preemption and prefix hits, colocated and disaggregated; rejected drafts' blocks go back to the pool."""

from __future__ import annotations

import random

import pytest

from engine.core.engine import EngineConfig, LLMEngine
from engine.spec.ngram import SpeculativeConfig, lookup
from raypd import LLM, DisaggregatedParams, GuidedDecodingParams, SamplingParams
from tests.engine.test_engine import run
from tests.pools import wait_pools_full

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(max_tokens=32, temperature=0.1, n=2, seed=7, ignore_eos=True)
# Weights at 0.05 (not the tiny models' 0.15) make greedy text fall into loops and out of them: drafts are
# accepted and rejected both. Each family's pool preempts (a sliding window frees blocks: a smaller one).
WINDOW = {"sliding_window": 8}
FAMILIES = {"llama": ({}, 48), "qwen3": ({}, 48), "mistral": (WINDOW, 16), "qwen3_moe": ({}, 48),
            "deepseek_v3": ({}, 48), "gemma3": (WINDOW, 24), "gpt_oss": (WINDOW, 24)}


def looping_model(model_factory, arch: str) -> str:
    return model_factory(arch, initializer_range=0.05, **FAMILIES[arch][0])


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(10, 3000) for _ in range(rng.randint(4, 9))]
        out.append([rng.randrange(10, 3000) for _ in range(rng.randint(3, 8))] + span * 3)
    return out


def test_lookup_takes_what_followed_the_latest_longest_match():
    assert lookup([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert lookup([5, 1, 2, 3, 1, 2, 3, 9, 1, 2], 4, 2, 3) == [3, 9, 1, 2]  # the latest occurrence of (1, 2)
    assert lookup([7, 1, 2, 8, 2], 2, 1, 2) == [8, 2]  # (1, 2)... no: the 2-gram (8, 2) is new, the 1-gram 2 is not
    assert lookup([1, 2, 3], 2, 1, 2) == [] and lookup([4, 4], 0, 1, 2) == []


def _serve(model: str, spec: SpeculativeConfig | None, params: SamplingParams, prompts, num_blocks: int):
    """Two rounds of the prompts on one engine (the second hits the prefix cache), in chunks of 16 tokens and a
    pool that preempts: each round's outputs, and the engine's stats."""
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, speculative=spec)
    engine = LLMEngine(model, config)
    rounds = [run(engine, {0: [(i, p, params) for i, p in enumerate(prompts)]}) for _ in range(2)]
    return rounds, engine.stats()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_speculation_gives_the_tokens_and_logprobs_of_decoding_without_it(model_factory, arch):
    model = looping_model(model_factory, arch)
    prompts = repetitive_prompts(6, seed=len(arch))
    pool = FAMILIES[arch][1]
    # Latent attention's decode path pads its queries' contexts, so its logits differ in the last bits with the
    # step's company (docs/reliability.md): a seeded draw near a boundary can flip; greedy tokens hold.
    for params in (GREEDY,) if arch == "deepseek_v3" else (GREEDY, SEEDED):
        want, plain = _serve(model, None, params, prompts, pool)
        got, stats = _serve(model, SPEC, params, prompts, pool)
        assert plain["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        for a, b in zip(got, want):
            for rid, candidates in b.items():
                for k, (tokens, logprobs) in candidates.items():
                    assert a[rid][k][0] == tokens, f"{arch} request {rid} candidate {k}"
                    for mine, theirs, t in zip(a[rid][k][1], logprobs, tokens):
                        assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4)
        if params is GREEDY:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


def test_no_drafts_above_the_batch_size_limit_or_for_a_grammar(model_factory):
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(3)
    engine = LLMEngine(model, EngineConfig(block_size=4, speculative=SpeculativeConfig(disable_by_batch_size=2)))
    run(engine, {0: [(i, p, GREEDY) for i, p in enumerate(prompts)]})
    assert engine.stats()["spec_draft_tokens"] == 0  # three run at once: over the limit
    run(engine, {0: [(9, prompts[0], GREEDY)]})
    assert engine.stats()["spec_draft_tokens"] > 0
    before = engine.stats()["spec_draft_tokens"]
    grammar = GuidedDecodingParams(regex="(ab)+")
    run(engine, {0: [(10, prompts[1], SamplingParams(max_tokens=12, temperature=0, guided_decoding=grammar))]})
    assert engine.stats()["spec_draft_tokens"] == before


def test_speculation_on_the_decode_side_of_a_hand_off(model_factory):
    """Prefill without speculation, decode with it: the tokens of colocated decoding without it, greedy and seeded,
    and again when the decode side holds the prompt's blocks."""
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(2, seed=5)
    with LLM(model, block_size=4, kv_transfer="nixl") as ctx, \
            LLM(model, block_size=4, kv_transfer="nixl", speculative=SPEC) as gen:
        for params in (GREEDY, SEEDED):
            for prompt in prompts:
                ref = ctx.generate(prompt, params, use_tqdm=False)
                for _ in range(2):
                    c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
                    dp = c.disaggregated_params
                    dp.request_type = "generation_only"
                    g = gen.generate(prompt, params, disaggregated_params=dp)
                    assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
                    assert [o.text for o in g.outputs] == [o.text for o in ref.outputs]
        assert gen.engine.stats()["spec_accepted_tokens"] > 0
        wait_pools_full(ctx, gen)
