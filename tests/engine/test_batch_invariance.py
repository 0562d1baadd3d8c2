"""Batch-invariant engines (EngineConfig.batch_invariant): a sequence's logits, and so its seeded tokens and their
logprobs, are the same bits alone or batched, with its prompt chunked or partly cached, and after a resume that
recomputes its tokens so far as a prompt."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.engine import EngineConfig, LLMEngine
from llmapi import SamplingParams
from llmapi.outputs import Resume, ResumedCandidate
from tests.engine.test_engine import prompts, run

SEEDED = SamplingParams(max_tokens=40, temperature=0.8, seed=9, n=2, ignore_eos=True, logprobs=1)
CONFIG = EngineConfig(block_size=4, batch_invariant=True)


def _bits(got: dict) -> dict:
    """{candidate: (tokens, [(token, logprob, rank) ...])}: what must match bit for bit."""
    return {k: (tokens, [(t, e[t].logprob, e[t].rank) for t, e in zip(tokens, lps)]) for k, (tokens, lps) in got.items()}


@pytest.fixture(scope="module")
def alone(tiny_llama):
    prompt = prompts(1, 30, 30, seed=11)[0]
    return prompt, _bits(run(LLMEngine(tiny_llama, CONFIG), {0: [(0, prompt, SEEDED)]})[0])


def test_batched_chunked_and_cached_gives_the_same_bits(tiny_llama, alone):
    """Among requests that arrive before and after it (greedy and seeded), with a 16-token step budget (its prompt in
    chunks, the others' too), and its first 16 tokens already cached by an earlier prompt."""
    prompt, want = alone
    engine = LLMEngine(tiny_llama, dataclasses.replace(CONFIG, max_num_batched_tokens=16))
    others = prompts(5, 5, 50, seed=12)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    other_seeded = dataclasses.replace(SEEDED, seed=4)
    arrivals = {0: [(1, prompt[:16] + others[0], greedy), (2, others[1], other_seeded)],
                3: [(0, prompt, SEEDED), (3, others[2], greedy)], 6: [(4, others[3], other_seeded)],
                9: [(5, others[4], greedy)]}
    got = run(engine, arrivals)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 16
    assert _bits(got[0]) == want


def test_a_resumed_request_continues_with_the_same_bits(tiny_llama, alone):
    """Resumed after 17 tokens on another engine: its prompt and tokens so far are prefilled as one prompt (the
    uninterrupted run computed those tokens' KV one decode step at a time)."""
    prompt, want = alone
    cut = 17
    resume = Resume(tuple(ResumedCandidate(k, tuple(tokens[:cut]), sum(lp for _, lp, _ in entries[:cut]))
                          for k, (tokens, entries) in want.items()))
    engine = LLMEngine(tiny_llama, CONFIG)
    engine.add_request(0, prompt, SEEDED, resume=resume)
    got = run(engine, {0: []})[0]
    assert _bits(got) == {k: (tokens[cut:], entries[cut:]) for k, (tokens, entries) in want.items()}


def test_what_batch_invariance_does_not_cover_is_refused(tiny_llama, model_factory):
    with pytest.raises(ValueError, match="latent or with sinks"):
        LLMEngine(model_factory("deepseek_v3"), CONFIG)
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
