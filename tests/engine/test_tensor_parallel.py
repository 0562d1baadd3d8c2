"""Tensor parallelism in the engine: ranks are real child processes joined over gloo; tokens against transformers'
and against one rank, through the embedded LLM."""

from __future__ import annotations

import functools
import signal
import time

import pytest
import torch

from engine.config import load_spec
from engine.model.causal_lm import CausalLM
from engine.parallel.shard import Shard
from llmapi import SamplingParams
from raypd.llm import LLM
from raypd.tools.tiny import build_tiny_model
from tests.conftest import perturb
from tests.engine.images import case, mm
from tests.engine.parity import Reference, assert_same_tokens
from tests.engine.test_engine import prompts
from tests.engine.together import Prestarted, selected

# What each family adds under sharding: biases of q/k/v and o_proj (o_proj's added once), a tied head; per-head
# q/k norms with a head_dim that is not hidden / heads; experts split inside, and a shared expert with its gate;
# latent attention (heads split, the latent cache whole on every rank) with grouped routing; Gemma 3's layer (its
# post-attention norm after the all-reduce) and scaled embeddings over vocab-parallel rows.
VARIANTS = {
    "llama": dict(arch="llama", attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", head_dim=48),
    "qwen2_moe": dict(arch="qwen2_moe"),
    "deepseek_v3": dict(arch="deepseek_v3", attention_bias=True),
    "gemma3": dict(arch="gemma3", sliding_window=8, attention_bias=True),
    "gpt_oss": dict(arch="gpt_oss", sliding_window=8),  # sinks split by heads, each expert's width by ranks
}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_tiny_model(tmp_path_factory.mktemp(f"tp-{name}"), **VARIANTS[name])
            perturb(built[name])  # nonzero biases: an o_proj bias added by every rank would show
        return str(built[name])

    return get


def tp_llm(model_dir, size, **kwargs) -> LLM:
    # 8 MiB of KV (thousands of tokens of these models), not the default 512: every rank allocates its share at start
    kwargs.setdefault("kv_cache_bytes", 8 << 20)
    return LLM(model_dir, tensor_parallel_size=size, num_threads=1, block_size=4, dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def two_rank_llms(request, checkpoint):
    """variant -> its two-rank LLM, for the test to take (and shut down); every selected variant's starts in the
    background when the first is asked for."""
    names = selected(request, test_two_ranks_match_transformers, "variant", list(VARIANTS))
    started = Prestarted({name: functools.partial(tp_llm, checkpoint(name), 2) for name in names},
                         lambda llm: llm.shutdown())
    yield started
    started.close()


def assert_matches_transformers(llm: LLM, ref: Reference, batch: list[list[int]], label: str) -> None:
    for i, (prompt, out) in enumerate(zip(batch, llm.generate(batch, GREEDY, use_tqdm=False))):
        tokens, gaps, ref_lps = ref.greedy(prompt, GREEDY.max_tokens)
        ours = out.outputs[0]
        assert_same_tokens(ours.token_ids, tokens, gaps, f"{label} prompt {i}")
        for pos, (tok, entry) in enumerate(zip(ours.token_ids, ours.logprobs)):
            if tok != tokens[pos]:
                break
            assert abs(entry[tok].logprob - float(ref_lps[pos][tok])) < LOGPROB_TOL, f"{label} prompt {i} pos {pos}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_match_transformers(checkpoint, two_rank_llms, variant):
    model_dir = checkpoint(variant)
    with two_rank_llms.take(variant) as llm:
        assert_matches_transformers(llm, Reference(model_dir), prompts(3, 5, 40, seed=1), f"{variant} TP2")


def test_four_ranks_share_the_two_kv_heads(checkpoint):
    model_dir = checkpoint("llama")
    assert load_spec(model_dir).num_kv_heads == 2
    with tp_llm(model_dir, 4) as llm:
        assert llm.engine.kv_cache.layout.num_kv_heads == 1 and llm.engine.kv_cache.layout.tp_size == 4
        assert_matches_transformers(llm, Reference(model_dir), prompts(2, 5, 30, seed=2), "llama TP4")


def test_shards_hold_the_checkpoints_slices(checkpoint):
    """Rank by rank, q/k/v rows and o_proj columns of each rank's heads, expert slices, the embedding table's and LM
    head's vocabulary rows: together the whole."""
    model_dir = checkpoint("qwen2_moe")
    whole = CausalLM.from_pretrained(model_dir, dtype="float32", pack=False)
    parts = [CausalLM.from_pretrained(model_dir, dtype="float32", pack=False, shard=Shard(r, 2, lambda x: x))
             for r in range(2)]
    spec, (a, b) = whole.spec, parts
    for name in ("embed_tokens", "lm_head"):
        assert torch.equal(torch.cat([getattr(p, name).weight for p in parts]), getattr(whole, name).weight)
    q, kv = spec.num_heads * spec.head_dim // 2, spec.num_kv_heads * spec.head_dim // 2
    for layer, la, lb in zip(whole.layers, a.layers, b.layers):
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([2 * q, 2 * kv, 2 * kv])
        (qa, ka, va), (qb, kb, vb) = (p.self_attn.qkv_proj.weight.split([q, kv, kv]) for p in (la, lb))
        assert torch.equal(torch.cat([qa, qb]), wq) and torch.equal(torch.cat([ka, kb]), wk)
        assert torch.equal(torch.cat([va, vb]), wv)
        assert torch.equal(torch.cat([la.self_attn.o_proj.weight, lb.self_attn.o_proj.weight], 1),
                           layer.self_attn.o_proj.weight)
        if hasattr(layer.mlp, "experts"):
            w2 = [p.mlp.experts[3].w2.weight for p in (la, lb)]
            assert torch.equal(torch.cat(w2, 1), layer.mlp.experts[3].w2.weight)
            assert torch.equal(la.mlp.gate.weight, layer.mlp.gate.weight)


def test_forks_prefix_hits_chunks_and_preemption_equal_one_rank(tiny_llama):
    """Seeded n=2 (the fork's block copy repeated on rank 1), a prompt sharing a cached prefix, chunked prefill and
    a pool too small for the batch (preemption): two ranks give one rank's tokens."""
    shared = prompts(1, 24, 24, seed=3)[0]
    batch = [shared + p for p in prompts(4, 10, 30, seed=4)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, n=2, ignore_eos=True)
    config = dict(max_num_batched_tokens=16, num_blocks=40)
    outputs = {}
    for size in (1, 2):
        with tp_llm(tiny_llama, size, **config) as llm:
            first = llm.generate(batch[:1], params, use_tqdm=False)
            rest = llm.generate(batch[1:], params, use_tqdm=False)
            stats = llm.engine.stats()
            assert stats["prefix_cache_hit_tokens"] >= 24 and stats["num_preemptions"] > 0, stats
            outputs[size] = [[c.token_ids for c in out.outputs] for out in first + rest]
    assert outputs[2] == outputs[1]


def test_images_under_two_ranks_equal_one_rank(llava_factory):
    model_dir = str(llava_factory())
    text, images = case("two")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = []
    for size in (1, 2):
        with tp_llm(model_dir, size) as llm:
            tokens.append(llm.generate(mm(text, images), params, use_tqdm=False).outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_a_killed_rank_fails_its_requests_and_the_llm_says_so(tiny_llama):
    llm = tp_llm(tiny_llama, 2)
    procs = list(llm.engine.ranks._members.procs.values())
    try:
        result = llm.generate_async(prompts(1, 10, 10)[0], SamplingParams(max_tokens=1500, ignore_eos=True))
        time.sleep(0.5)  # decoding
        procs[0].send_signal(signal.SIGKILL)
        with pytest.raises(Exception, match="rank 1 was killed by SIGKILL"):
            result.result(timeout=30)
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate(prompts(1, 5, 5)[0], use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in procs)


def test_what_cannot_be_split_is_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide .*num_attention_heads 4"):
        tp_llm(tiny_llama, 3)
