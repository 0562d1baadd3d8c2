"""LLMEngine against transformers: greedy tokens and logprobs, under batching, chunking and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.kv.block_manager import request_blocks
from llmapi import SamplingParams
from tests.engine.parity import Reference, assert_same_tokens

ARCH_VARIANTS = {
    "llama": dict(attention_bias=True, tie_word_embeddings=True),
    "qwen2": {},
    "qwen3": dict(head_dim=48),
    "mistral": dict(sliding_window=8),
}


def prompts(count: int, lo: int, hi: int, vocab: int = 4000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def run(engine: LLMEngine, arrivals: dict[int, list[tuple[int, list[int], SamplingParams]]], max_steps: int = 2000):
    """Steps the engine, adding requests at the given steps; returns request id -> {candidate: (tokens, logprobs)}."""
    got: dict[int, dict[int, tuple[list[int], list]]] = {}
    for step in range(max_steps):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for rsp in engine.step():
            for d in rsp.deltas:
                tokens, lps = got.setdefault(rsp.request_id, {}).setdefault(d.index, ([], []))
                tokens.extend(d.token_ids)
                lps.extend(d.logprobs or [])
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "engine did not finish"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    return got


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", list(ARCH_VARIANTS))
def test_greedy_matches_transformers_per_architecture(model_factory, arch):
    model_dir = model_factory(arch, **ARCH_VARIANTS[arch])
    ref = Reference(model_dir)
    engine = LLMEngine(model_dir, EngineConfig(block_size=4))
    batch = prompts(5, 3, 40, seed=1)
    got = run(engine, {0: [(i, p, GREEDY) for i, p in enumerate(batch)]})
    for i, p in enumerate(batch):
        tokens, gaps, _ = ref.greedy(p, GREEDY.max_tokens)
        assert_same_tokens(got[i][0][0], tokens, gaps, f"{arch} prompt {i}")


def test_arrivals_while_decoding_with_chunked_prefill(tiny_llama):
    ref = Reference(tiny_llama)
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, max_num_batched_tokens=16))
    batch = prompts(6, 20, 60, seed=2)  # every prompt is longer than the per-step budget
    arrivals = {0: [(0, batch[0], GREEDY), (1, batch[1], GREEDY)], 3: [(2, batch[2], GREEDY)],
                7: [(3, batch[3], GREEDY), (4, batch[4], GREEDY)], 12: [(5, batch[5], GREEDY)]}
    got = run(engine, arrivals)
    for i, p in enumerate(batch):
        tokens, gaps, _ = ref.greedy(p, GREEDY.max_tokens)
        assert_same_tokens(got[i][0][0], tokens, gaps, f"prompt {i}")


def test_preemption_by_recompute_keeps_tokens(tiny_llama):
    ref = Reference(tiny_llama)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    # 4 requests of ~40 tokens need ~40 blocks of 4; the pool has 24, so some must be preempted and recomputed.
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=24))
    batch = prompts(4, 18, 24, seed=3)
    got = run(engine, {0: [(i, p, params) for i, p in enumerate(batch)]})
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(batch):
        tokens, gaps, _ = ref.greedy(p, params.max_tokens)
        assert_same_tokens(got[i][0][0], tokens, gaps, f"prompt {i}")


@pytest.mark.parametrize("arch, overrides, num_blocks", [
    ("deepseek_v3", {}, 24), ("qwen3_moe", {}, 24),
    # a window layer holds ~7 blocks of a sequence, not ~14: the same memory would preempt nothing
    ("gemma3", dict(sliding_window=8), 12), ("gpt_oss", dict(sliding_window=8), 12)])
def test_new_families_under_chunking_and_preemption_match_transformers(model_factory, arch, overrides, num_blocks):
    """DeepSeek-V3 (latents written by prefill chunks, read back expanded by later chunks and absorbed by decode;
    recomputed after preemption), Qwen3-MoE, and Gemma 3 and gpt-oss with prompts longer than their windows: greedy
    tokens and their logprobs as transformers'."""
    model_dir = model_factory(arch, **overrides)
    ref = Reference(model_dir)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    engine = LLMEngine(model_dir, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16))
    batch = prompts(4, 18, 26, seed=7)  # ~40 tokens each: 4 need ~40 blocks of every layer
    got = run(engine, {0: [(i, p, params) for i, p in enumerate(batch)]})
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(batch):
        tokens, gaps, ref_lps = ref.greedy(p, params.max_tokens)
        ours, lps = got[i][0]
        assert_same_tokens(ours, tokens, gaps, f"{arch} prompt {i}")
        for pos, (tok, entry) in enumerate(zip(ours, lps)):
            if tok != tokens[pos]:
                break
            assert abs(entry[tok].logprob - float(ref_lps[pos][tok])) < 1e-4, f"{arch} prompt {i} pos {pos}"


def test_sliding_window_layers_hold_only_their_window(model_factory):
    """Gemma 3 (window 8; 3 window layers, 1 full): while a long prompt is prefilled in chunks and decoded, a window
    layer holds at most the blocks of its window and one chunk, the full layer every block; at the end the pool is
    whole again."""
    model_dir = model_factory("gemma3", sliding_window=8)
    engine = LLMEngine(model_dir, EngineConfig(block_size=4, max_num_batched_tokens=16))
    bm = engine.block_manager
    engine.add_request(0, list(range(10, 70)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    peak = after_prefill = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.requests[0].seqs[0] if 0 in engine.requests else None
        if seq is not None:
            held = [sum(b >= 0 for b in table) for table in seq.block_tables]
            peak = max(peak, max(held[1:]))
            after_prefill = after_prefill or (seq.num_computed_tokens >= 60 and held)
            assert held[0] == -(-seq.num_computed_tokens // 4)  # the full layer: every block computed
    assert bm.windows == (None, 8, 8, 8)
    assert peak <= -(-(16 + 8 - 1) // 4) + 1  # a window and a chunk
    assert after_prefill[1:] == [2, 2, 2]  # from position 60 on, keys 53..: blocks 13 and 14
    assert bm.num_free_blocks == bm.num_blocks


def test_logprobs_equal_transformers_log_softmax(tiny_llama):
    ref = Reference(tiny_llama)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4))
    batch = prompts(3, 5, 30, seed=4)
    got = run(engine, {0: [(i, p, params) for i, p in enumerate(batch)]})
    for i, p in enumerate(batch):
        tokens, gaps, ref_lps = ref.greedy(p, params.max_tokens)
        ours, lps = got[i][0]
        assert_same_tokens(ours, tokens, gaps, f"prompt {i}")
        for pos, (tok, entry) in enumerate(zip(ours, lps)):
            assert entry[tok].rank == 1
            top = ref_lps[pos].topk(3)
            for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert entry[tid].rank == rank
                assert abs(entry[tid].logprob - value) < 1e-4


def test_prompt_logprobs_and_context_logits(tiny_llama):
    ref = Reference(tiny_llama)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, return_context_logits=True)
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, max_num_batched_tokens=8))  # chunked prompt
    prompt = prompts(1, 20, 20, seed=5)[0]
    engine.add_request(0, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            first = first or rsp
    with torch.no_grad():
        logits = ref.model(torch.tensor([prompt])).logits[0]
    assert first.context_logits.shape == logits.shape
    assert (first.context_logits - logits).abs().max() < 1e-4
    assert first.prompt_logprobs[0] is None
    lp = logits.log_softmax(-1)
    for i in range(1, len(prompt)):
        assert abs(first.prompt_logprobs[i][prompt[i]].logprob - float(lp[i - 1, prompt[i]])) < 1e-4


def test_bad_requests_are_refused_with_the_reason(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(0, [], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(1, [1, 10**9], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(2, [5] * 2040, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(3, [5] * 30, SamplingParams(max_tokens=10))
    # candidates share the prompt's 3 full blocks and need 2 each of their own: 2 fit the 8-block pool, 3 do not
    three = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=0)
    assert request_blocks(12, 8, 3, 4) == 9 > 8 >= request_blocks(12, 8, 2, 4) == 7
    with pytest.raises(ValueError, match=r"KV blocks \(3 candidate"):
        engine.add_request(4, [5] * 12, three)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=7, n=2, ignore_eos=True, logprobs=1),
], ids=["greedy", "seeded-n2"])
def test_a_resumed_request_continues_exactly(tiny_llama, params):
    """A lost worker's request, resumed on another engine from its candidates' tokens so far, goes on with the
    tokens it would have produced."""
    from llmapi.outputs import Resume, ResumedCandidate

    prompt = prompts(1, 12, 12, seed=8)[0]
    whole = run(LLMEngine(tiny_llama, EngineConfig(block_size=4)), {0: [(0, prompt, params)]})[0]
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4))
    so_far = {k: tokens[:5] for k, (tokens, _) in whole.items()}
    lps = {k: sum(entry[t].logprob for t, entry in zip(tokens[:5], lp)) if lp else 0.0
           for k, (tokens, lp) in whole.items()}
    resume = Resume(tuple(ResumedCandidate(k, tuple(t), lps[k]) for k, t in so_far.items()))
    engine.add_request(1, prompt, params, resume=resume)
    got = {}
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            for d in rsp.deltas:
                got.setdefault(d.index, []).extend(d.token_ids)
    assert {k: so_far[k] + got[k] for k in got} == {k: tokens for k, (tokens, _) in whole.items()}
    with pytest.raises(ValueError, match="resumed candidate"):
        engine.add_request(2, prompt, params, resume=Resume((ResumedCandidate(5, (1,)),)))
