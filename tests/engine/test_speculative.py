"""Speculative decoding (n-gram drafts): the same tokens and logprobs as without it, every family, under chunked
prefill, preemption and prefix hits, colocated and disaggregated; rejected drafts' blocks go back to the pool."""

from __future__ import annotations

import dataclasses
import functools
import random
import time

import pytest

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.request import EngineRequest, Sequence
from engine.core.scheduler import Scheduler
from engine.kv.block_manager import BlockManager
from engine.kv.kv_connector import NullConnector
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramDrafter, lookup
from llmapi.outputs import Resume, ResumedCandidate
from raypd import LLM, DisaggregatedParams, GuidedDecodingParams, SamplingParams
from tests.engine.test_engine import run
from tests.engine.together import close_together, start_each
from tests.pools import wait_pools_full

POOL = 8 << 20  # KV bytes per engine (2048 tokens of the tiny llama): the suite runs in one process
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(max_tokens=32, temperature=0.1, n=2, seed=7, ignore_eos=True)
# Weights at 0.05 (not the tiny models' 0.15) make greedy text fall into loops and out of them: drafts are
# accepted and rejected both. Each family's pool preempts (a sliding window frees blocks: a smaller one).
WINDOW = {"sliding_window": 8}
FAMILIES = {"llama": ({}, 48), "qwen2": ({}, 48), "qwen3": ({}, 48), "mistral": (WINDOW, 16), "qwen2_moe": ({}, 48),
            "qwen3_moe": ({}, 48), "mixtral": ({}, 48), "deepseek_v2": ({}, 48), "deepseek_v3": ({}, 48),
            "gemma3": (WINDOW, 24), "gpt_oss": (WINDOW, 24)}
LATENT = ("deepseek_v2", "deepseek_v3")


def looping_model(model_factory, arch: str) -> str:
    return model_factory(arch, initializer_range=0.05, **FAMILIES[arch][0])


def family_prompts(arch: str) -> list[list[int]]:
    return repetitive_prompts(6, seed=len(arch))


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(10, 3000) for _ in range(rng.randint(4, 9))]
        out.append([rng.randrange(10, 3000) for _ in range(rng.randint(3, 8))] + span * 3)
    return out


def test_lookup_takes_what_followed_the_latest_longest_match_with_k_after_it():
    assert lookup([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert lookup([5, 1, 2, 3, 1, 2, 3, 9, 1, 2], 4, 2, 3) == [3, 9, 1, 2]  # (9, 1, 2) is new; the latest (1, 2)
    assert lookup([5, 1, 2, 8, 1, 2, 9, 4, 1, 2], 2, 2, 2) == [9, 4]  # the latest (1, 2) with 2 tokens after it
    assert lookup([5, 6, 7, 5, 6, 7, 5, 6], 4, 2, 2) == [7, 5, 6, 7]  # the latest has 3 after it: the earliest, 5
    assert lookup([7, 1, 2, 8, 2], 2, 1, 2) == [8, 2]  # the 2-gram (8, 2) is new; the 1-gram 2 is not
    assert lookup([1, 2, 3], 2, 1, 2) == [] and lookup([4, 4], 0, 1, 2) == []


def _serve(model: str, spec: SpeculativeConfig | None, params: SamplingParams, prompts, num_blocks: int):
    """Two rounds of the prompts on one engine (the second hits the prefix cache), in chunks of 16 tokens and a
    pool that preempts: each round's outputs, and the engine's stats."""
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, speculative_config=spec)
    engine = LLMEngine(model, config)
    rounds = [run(engine, {0: [(i, p, params) for i, p in enumerate(prompts)]}) for _ in range(2)]
    return rounds, engine.stats()


@pytest.fixture(scope="module")
def unspeculated(model_factory):
    """unspeculated(arch, params) -> _serve's rounds without speculation of the family's prompts in its pool: what
    the n-gram and the draft-model runs of that family are held to, computed once per module (only read)."""
    done = {}

    def get(arch: str, params: SamplingParams):
        key = (arch, id(params))  # GREEDY or SEEDED: module constants
        if key not in done:
            done[key] = _serve(looping_model(model_factory, arch), None, params, family_prompts(arch),
                               FAMILIES[arch][1])[0]
        return done[key]

    return get


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_speculation_gives_the_tokens_and_logprobs_of_decoding_without_it(model_factory, unspeculated, arch):
    model = looping_model(model_factory, arch)
    prompts = family_prompts(arch)
    pool = FAMILIES[arch][1]
    # Latent attention's decode path pads its queries' contexts, so its logits differ in the last bits with the
    # step's company (docs/reliability.md): a seeded draw near a boundary can flip; greedy tokens hold.
    preempted = hits = 0
    for params in (GREEDY,) if arch in LATENT else (GREEDY, SEEDED):
        want = unspeculated(arch, params)
        got, stats = _serve(model, SPEC, params, prompts, pool)
        preempted += stats["num_preemptions"]
        hits += stats["prefix_cache_hit_tokens"]
        for a, b in zip(got, want):
            for rid, candidates in b.items():
                for k, (tokens, logprobs) in candidates.items():
                    assert a[rid][k][0] == tokens, f"{arch} request {rid} candidate {k}"
                    for mine, theirs, t in zip(a[rid][k][1], logprobs, tokens):
                        assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4)
        if params is GREEDY:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert preempted > 0 and hits > 0  # the runs went through preemption and prefix hits


def test_no_drafts_above_the_batch_size_limit_or_for_a_grammar(model_factory):
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(3)
    engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_bytes=POOL,
                                           speculative_config=SpeculativeConfig(disable_by_batch_size=2)))
    run(engine, {0: [(i, p, GREEDY) for i, p in enumerate(prompts)]})
    assert engine.stats()["spec_draft_tokens"] == 0  # three run at once: over the limit
    run(engine, {0: [(9, prompts[0], GREEDY)]})
    assert engine.stats()["spec_draft_tokens"] > 0
    before = engine.stats()["spec_draft_tokens"]
    grammar = GuidedDecodingParams(regex="(ab)+")
    run(engine, {0: [(10, prompts[1], SamplingParams(max_tokens=12, temperature=0, guided_decoding=grammar))]})
    assert engine.stats()["spec_draft_tokens"] == before


def test_speculation_across_a_hand_off(model_factory):
    """Prefill and decode with and without speculation: the tokens of colocated decoding without it, greedy and
    seeded, and again when the decode side holds the prompt's blocks. A speculating prefill side returns its drafts
    after the first token in draft_tokens; a speculating decode side verifies them in its first step, one that
    does not speculate ignores them."""
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(2, seed=5)
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl") as plain, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=spec) as speculating, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=spec) as other:
        for params in (GREEDY, SEEDED):
            for prompt in prompts:
                ref = plain.generate(prompt, params, use_tqdm=False)
                for ctx, gen in ((plain, speculating), (speculating, other), (speculating, plain)):
                    c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
                    dp = c.disaggregated_params
                    first = dp.first_gen_tokens
                    drafts = lookup(prompt + first, 4, 1, 3) if ctx is speculating and params.n == 1 else []
                    assert (dp.draft_tokens or []) == drafts
                    dp.request_type = "generation_only"
                    g = gen.generate(prompt, params, disaggregated_params=dp)
                    assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
                    assert [o.text for o in g.outputs] == [o.text for o in ref.outputs]
        assert speculating.engine.stats()["spec_accepted_tokens"] > 0 and other.engine.stats()["spec_draft_tokens"] > 0
        # each candidate's drafts and accepted tokens are in its metrics
        outs = speculating.generate(prompts, GREEDY, use_tqdm=False)
        counts = [(o.metrics[0]["spec_draft_tokens"], o.metrics[0]["spec_accepted_tokens"]) for o in outs]
        assert all(d >= a for d, a in counts) and sum(a for _, a in counts) > 0
        assert "spec_draft_tokens" not in plain.generate(prompts[0], GREEDY).metrics[0]
        # drafts that are wrong cost a verification, never a token
        ref = plain.generate(prompts[0], GREEDY, use_tqdm=False)
        dp = speculating.generate(prompts[0], GREEDY,
                                  disaggregated_params=DisaggregatedParams(request_type="context_only")).disaggregated_params
        dp.request_type, dp.draft_tokens = "generation_only", [3000, 3001, 3002]
        before = other.engine.stats()["spec_draft_tokens"]
        g = other.generate(prompts[0], GREEDY, disaggregated_params=dp)
        assert g.outputs[0].token_ids == ref.outputs[0].token_ids
        assert other.engine.stats()["spec_draft_tokens"] >= before + 3
        wait_pools_full(plain, speculating, other)


def test_rejected_drafts_give_their_blocks_back(model_factory):
    """After every step a sequence holds only the blocks its tokens need (a rejected draft's are back in the pool)."""
    model = looping_model(model_factory, "llama")
    spec = SpeculativeConfig(num_speculative_tokens=9, prompt_lookup_min=1)  # drafts that cross blocks of 4
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, speculative_config=spec))
    for i, prompt in enumerate(repetitive_prompts(3, seed=9)):
        engine.add_request(i, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        bm.check()
        for seq in engine.scheduler.running:
            assert len(seq.block_tables[0]) <= bm.blocks_for(seq.num_tokens)
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert bm.num_free_blocks == bm.num_blocks


def _decoding(seq_id: int, tokens: list[int], bm: BlockManager) -> Sequence:
    """A running sequence whose tokens but the last are computed (it has sampled)."""
    req = EngineRequest(seq_id, tokens[:4], SamplingParams(max_tokens=64, temperature=0))
    seq = Sequence(seq_id, req, 0, list(tokens))
    req.seqs.append(seq)
    req.forked = True
    bm.admit(seq, bm.lookup([]))
    bm.allocate(seq, len(tokens) - 1)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_drafts_take_only_blocks_left_free_and_never_preempt():
    """Drafts are added once every running sequence has its place, from the blocks then free: a guess never
    preempts a sequence, nor takes the block another needs for its next token."""
    bm = BlockManager(12, 4, enable_prefix_caching=False)
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1), 2048)
    sched = Scheduler(bm, NullConnector(), 64, 8, drafter)
    loop = [5, 6, 7] * 4 + [5, 6]  # 14 tokens, 13 computed: 4 blocks each, positions 13-15 free in the last
    a, b, c = _decoding(0, loop, bm), _decoding(1, loop, bm), _decoding(2, loop[:12], bm)  # c: 3 blocks
    for s in (a, b, c):
        sched.add_running(s)
    assert bm.num_free_blocks == 1
    out = sched.schedule()  # every next token fits its sequence's last block: no block taken before the drafts
    # a's 4 drafts (positions 14-17) take the free block; b's stop at position 15, the end of its last block; c's
    # would start a block (position 12): none
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 5), (1, 3), (2, 1)] and not out.preempted
    assert a.draft == [7, 5, 6, 7] and b.draft == [7, 5] and c.draft == [] and bm.num_free_blocks == 0


def test_a_seeded_request_resumed_on_a_speculating_engine_keeps_its_tokens(model_factory):
    """A decode worker lost mid-stream: another speculating engine, given the prompt and the tokens so far,
    continues each candidate with the tokens the first would have made (batch-invariant engines: the resumed
    prompt's recomputed KV has the first computation's bits)."""
    model = looping_model(model_factory, "llama")
    prompt = repetitive_prompts(1, seed=3)[0]
    config = EngineConfig(block_size=4, kv_cache_bytes=POOL, batch_invariant=True, speculative_config=SPEC)
    want = run(LLMEngine(model, dataclasses.replace(config, speculative_config=None)), {0: [(0, prompt, SEEDED)]})[0]
    cut = 9
    resume = Resume(tuple(ResumedCandidate(k, tuple(tokens[:cut])) for k, (tokens, _) in want.items()))
    engine = LLMEngine(model, config)
    engine.add_request(0, prompt, SEEDED, resume=resume)
    got = run(engine, {0: []})[0]
    assert {k: tokens for k, (tokens, _) in got.items()} == {k: tokens[cut:] for k, (tokens, _) in want.items()}
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_sampled_marginals_are_those_of_the_sampler_without_speculation(model_factory):
    """200 seeds at temperature 0.15, where drafts are often right and often wrong: every seed's tokens are those
    of decoding without speculation, so every position's marginal over the seeds is the same distribution (an
    acceptance rule that kept a wrong draft, or redrew after a rejection, would change both)."""
    model = looping_model(model_factory, "llama")
    prompt = repetitive_prompts(1, seed=3)[0]
    params = [dataclasses.replace(SEEDED, n=1, temperature=0.15, seed=s, max_tokens=8) for s in range(200)]
    got = {}
    for spec in (None, SPEC):
        engine = LLMEngine(model, EngineConfig(block_size=4, kv_cache_bytes=POOL, max_num_seqs=100,
                                               speculative_config=spec))
        out = run(engine, {0: [(i, prompt, p) for i, p in enumerate(params)]})
        got[spec] = [out[i][0][0] for i in range(len(params))]
    assert got[SPEC] == got[None]
    assert len({tuple(t) for t in got[None]}) > 20  # the seeds draw different texts
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 20 and stats["spec_draft_tokens"] > 2 * stats["spec_accepted_tokens"]


def test_speculation_under_tensor_parallelism(model_factory):
    """Two ranks: the other rank runs the verification steps rank 0 plans (each position a decode query)."""
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(3, seed=4)
    configs = [EngineConfig(block_size=4, kv_cache_bytes=POOL, tensor_parallel_size=2, num_threads=1,
                            speculative_config=spec) for spec in (None, SPEC)]
    engines = start_each([functools.partial(LLMEngine, model, config) for config in configs], LLMEngine.close)
    try:
        plain, speculating = (run(engine, {0: [(i, p, GREEDY) for i, p in enumerate(prompts)]}) for engine in engines)
        stats = engines[1].stats()
    finally:
        close_together(engines, LLMEngine.close)
    assert {r: c[0][0] for r, c in speculating.items()} == {r: c[0][0] for r, c in plain.items()}
    assert stats["spec_accepted_tokens"] > 0



def noisy_draft(target: str, out) -> SpeculativeConfig:
    """A draft that agrees with the looping model often, not always: its weights with 5% noise (random-weight
    models of fewer layers agree with it almost never)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * p.std() * 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return SpeculativeConfig(method="draft_model", model=str(out), num_speculative_tokens=3)


@pytest.fixture(scope="module")
def noisy_drafts(model_factory, tmp_path_factory):
    """noisy_drafts(arch) -> the family's noisy_draft, written once per module."""
    done = {}

    def get(arch: str) -> SpeculativeConfig:
        if arch not in done:
            done[arch] = noisy_draft(looping_model(model_factory, arch), tmp_path_factory.mktemp(f"noisy-draft-{arch}"))
        return done[arch]

    return get


@pytest.fixture(scope="module")
def draft_spec(noisy_drafts) -> SpeculativeConfig:
    return noisy_drafts("llama")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_gives_the_tokens_of_decoding_without_it(model_factory, unspeculated, draft_spec, params):
    """Chunked prefill, preemption and prefix hits, as for n-gram drafts; the draft's own pool is empty after."""
    model = looping_model(model_factory, "llama")
    prompts = family_prompts("llama")
    want = unspeculated("llama", params)
    config = EngineConfig(block_size=4, num_blocks=FAMILIES["llama"][1], max_num_batched_tokens=16,
                          speculative_config=draft_spec)
    engine = LLMEngine(model, config)
    got = [run(engine, {0: [(i, p, params) for i, p in enumerate(prompts)]}) for _ in range(2)]
    assert [{r: {k: c[0] for k, c in cs.items()} for r, cs in g.items()} for g in got] == \
        [{r: {k: c[0] for k, c in cs.items()} for r, cs in w.items()} for w in want]
    for g, w in zip(got, want):
        for rid, candidates in w.items():
            for k, (tokens, logprobs) in candidates.items():
                for mine, theirs, t in zip(g[rid][k][1], logprobs, tokens):
                    assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4)
    stats, draft = engine.stats(), engine.scheduler.drafter.block_manager
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"] and stats["num_preemptions"] > 0
    assert draft.num_free_blocks == draft.num_blocks


def test_a_draft_model_on_the_decode_side_of_a_hand_off(model_factory, draft_spec):
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(2, seed=6)
    with LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl") as plain, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=draft_spec) as gen:
        for params in (GREEDY, SEEDED):
            for prompt in prompts:
                ref = plain.generate(prompt, params, use_tqdm=False)
                c = plain.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
                dp = c.disaggregated_params
                dp.request_type = "generation_only"
                g = gen.generate(prompt, params, disaggregated_params=dp)
                assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
        assert gen.engine.stats()["spec_accepted_tokens"] > 0
        wait_pools_full(plain, gen)


def test_a_draft_model_must_share_the_vocabulary(model_factory):
    other = model_factory("llama", vocab_size=5000)
    spec = SpeculativeConfig(method="draft_model", model=other)
    with pytest.raises(ValueError, match="draft model's vocabulary has 5000 tokens"):
        LLMEngine(looping_model(model_factory, "llama"), EngineConfig(kv_cache_bytes=POOL, speculative_config=spec))
    with pytest.raises(ValueError, match="draft_model needs"):
        SpeculativeConfig(method="draft_model")


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "llama"])
def test_a_draft_model_for_every_family(model_factory, unspeculated, noisy_drafts, arch):
    """Greedy tokens and logprobs of decoding without it, chunked and preempted."""
    model = looping_model(model_factory, arch)
    want = unspeculated(arch, GREEDY)
    got, stats = _serve(model, noisy_drafts(arch), GREEDY, family_prompts(arch), FAMILIES[arch][1])
    for g, w in zip(got, want):
        for rid, candidates in w.items():
            tokens, logprobs = candidates[0]
            assert g[rid][0][0] == tokens, f"{arch} request {rid}"
            for mine, theirs, t in zip(g[rid][0][1], logprobs, tokens):
                assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] and stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "llama"])
def test_every_family_speculates_on_the_decode_side_of_a_hand_off(model_factory, noisy_drafts, arch):
    """n-gram and draft-model drafts after a NIXL hand-off: the greedy tokens of colocated decoding without them."""
    model = looping_model(model_factory, arch)
    prompt = repetitive_prompts(1, seed=len(arch))[0]
    draft = noisy_drafts(arch)
    with LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl") as plain, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=SPEC) as ngram, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=draft) as drafting:
        ref = plain.generate(prompt, GREEDY, use_tqdm=False).outputs[0].token_ids
        for gen in (ngram, drafting):
            dp = plain.generate(prompt, GREEDY,
                                disaggregated_params=DisaggregatedParams(request_type="context_only")).disaggregated_params
            dp.request_type = "generation_only"
            assert gen.generate(prompt, GREEDY, disaggregated_params=dp).outputs[0].token_ids == ref, arch
            assert gen.engine.stats()["spec_draft_tokens"] > 0
        wait_pools_full(plain, ngram, drafting)


def draft_pools_full(*llms, timeout: float = 10.0) -> None:
    """wait_pools_full for the draft models' own pools (a held hand-off's draft blocks go with its lease)."""
    deadline = time.monotonic() + timeout
    for i, llm in enumerate(llms):
        bm = llm.engine.scheduler.drafter.block_manager
        while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bm.num_free_blocks == bm.num_blocks, f"LLM {i}: {bm.num_blocks - bm.num_free_blocks} draft blocks held"
        bm.check()


def _hand_off(ctx: LLM, gen: LLM, prompt: list[int], params: SamplingParams):
    """(the prefill side's DisaggregatedParams, the decode side's output, the decode engine's stats before it)."""
    dp = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only")
                      ).disaggregated_params
    before = gen.engine.stats()
    dp.request_type = "generation_only"
    return dp, gen.generate(prompt, params, disaggregated_params=dp), before


def test_a_draft_model_prefill_hands_its_drafts_and_prompt_kv_to_the_decode_side(model_factory, draft_spec):
    """Draft model on both sides of a NIXL hand-off: the prefill side's draft computes the prompt and drafts after
    the first token (its greedy tokens: draft_tokens); its KV of the prompt travels in the same signed handle, so
    the decode side's draft computes no prompt token, and the decode side's first step verifies the carried drafts.
    The tokens are colocated decoding's without speculation, greedy and seeded (n=2: no drafts carried, the draft
    computes the prompt); the lease ends with the read, and every pool, target and draft, is full again."""
    model = looping_model(model_factory, "llama")
    prompts = repetitive_prompts(2, seed=6)
    seeded = dataclasses.replace(SEEDED, n=1)
    with LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl") as plain, \
            LLM(draft_spec.model, block_size=4, kv_cache_bytes=POOL) as draft, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=draft_spec) as ctx, \
            LLM(model, block_size=4, kv_cache_bytes=POOL, kv_transfer="nixl", speculative_config=draft_spec) as gen:
        for params in (GREEDY, seeded, SEEDED):
            for prompt in prompts:
                ref = plain.generate(prompt, params, use_tqdm=False)
                dp, g, before = _hand_off(ctx, gen, prompt, params)
                assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
                after = gen.engine.stats()
                grew = {k: after[k] - before[k] for k in after if k.startswith("spec_")}
                if params.n > 1:
                    assert not dp.draft_tokens and grew["spec_draft_kv_imports"] == 0
                    assert grew["spec_draft_prompt_tokens"] == params.n * len(prompt)  # each twin computes it
                    continue
                assert len(dp.draft_tokens) == draft_spec.num_speculative_tokens
                if params is GREEDY:
                    first = dp.first_gen_tokens
                    want = draft.generate(prompt + first, dataclasses.replace(GREEDY, max_tokens=len(dp.draft_tokens)))
                    assert dp.draft_tokens == want.outputs[0].token_ids
                assert grew["spec_draft_kv_imports"] == 1 and grew["spec_draft_prompt_tokens"] == 0
                assert grew["spec_carried_draft_tokens"] == len(dp.draft_tokens)
                assert grew["spec_draft_tokens"] >= len(dp.draft_tokens)
        assert ctx.engine.stats()["spec_draft_prompt_tokens"] > 0  # the prefill side's draft computed the prompts
        wait_pools_full(plain, ctx, gen)
        draft_pools_full(ctx, gen)
        assert ctx.engine.stats()["kv_leases"] == 0


def test_mismatched_drafts_on_either_side_of_a_hand_off_keep_the_tokens(model_factory, draft_spec, caplog):
    """A draft-model prefill side to a decode side with n-gram drafts, none, or another draft model (its KV is
    ignored: that draft computes the prompt, said once), and a prefill side without one to a draft-model decode
    side: every pair gives the tokens of colocated decoding without speculation, greedy and seeded, and every pool
    (the unread draft KV's with its lease) is full again."""
    model = looping_model(model_factory, "llama")
    other = SpeculativeConfig(method="draft_model", num_speculative_tokens=2,
                              model=model_factory("llama", initializer_range=0.05, num_hidden_layers=1))
    prompt = repetitive_prompts(1, seed=8)[0]
    seeded = dataclasses.replace(SEEDED, n=1)
    kw = {"block_size": 4, "kv_cache_bytes": POOL, "kv_transfer": "nixl"}
    with LLM(model, **kw) as plain, LLM(model, **kw, speculative_config=draft_spec) as drafting, \
            LLM(model, **kw, speculative_config=SPEC) as ngram, LLM(model, **kw, speculative_config=other) as another:
        names = {plain: "plain", drafting: "drafting", ngram: "ngram", another: "another"}
        for params in (GREEDY, seeded):
            ref = plain.generate(prompt, params, use_tqdm=False).outputs[0].token_ids
            for ctx, gen in ((drafting, ngram), (drafting, plain), (drafting, another), (plain, drafting),
                             (ngram, drafting)):
                dp, g, before = _hand_off(ctx, gen, prompt, params)
                assert g.outputs[0].token_ids == ref
                after = gen.engine.stats()
                assert dp.draft_tokens or ctx is not drafting
                if dp.draft_tokens and gen is not plain:  # verified on the first step, whatever the decode side's method
                    assert after["spec_carried_draft_tokens"] > before["spec_carried_draft_tokens"], names[gen]
                if gen is another or gen is drafting:  # no usable draft KV: the draft computed the prompt
                    assert after["spec_draft_prompt_tokens"] - before["spec_draft_prompt_tokens"] == len(prompt)
                    assert after["spec_draft_kv_imports"] == before["spec_draft_kv_imports"]
        wait_pools_full(plain, drafting, ngram, another)
        draft_pools_full(drafting, another)
        said = [r for r in caplog.records if r.name == "engine.spec.draft_model" and "differs" in r.getMessage()]
        assert len(said) == 1  # two hand-offs to the other draft, one warning
        assert drafting.engine.stats()["kv_leases"] == 0
