"""Model code against transformers: logits, greedy tokens through the paged cache, loading, fingerprints."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.model.attention import AttentionMetadata, SeqSlice
from engine.config import SUPPORTED_ARCHITECTURES, auto_dtype, load_spec
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from raypd.tools.tiny import build_tiny_model
from tests.conftest import perturb

# Each variant exercises what its family adds: biases (+ tied head), per-head q/k norms with a head_dim that is not
# hidden/heads, and a sliding window shorter than the prompts.
VARIANTS = {
    "llama": dict(arch="llama", attention_bias=True, tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "mistral": dict(arch="mistral", sliding_window=8),
    # Windows on some layers only (layers >= max_window_layers), so one step uses two mask sets.
    "qwen2_swa": dict(arch="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2),
    # Mixture of experts: Qwen3-MoE with a dense first layer and renormalized top-k; every other layer sparse and
    # raw top-k probabilities; Mixtral (always renormalized, float32 routing weights) with a sliding window.
    "qwen3_moe": dict(arch="qwen3_moe"),
    "qwen3_moe_step2": dict(arch="qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
    # Weights at std 0.1 (the builder's 0.15 grows Mixtral's full-width experts' residual stream to ~85, where
    # one-ulp differences of the SiLU, the C++ kernel's against torch's, reach 1.3e-4 on the logits on AVX-512 CPUs).
    "mixtral": dict(arch="mixtral", sliding_window=8, initializer_range=0.1),
    # Qwen2-MoE: q/k/v biases (perturbed), raw top-k weights and a sigmoid-gated shared expert.
    "qwen2_moe": dict(arch="qwen2_moe"),
    # DeepSeek-V3: latent attention (q through its low-rank path, interleaved rope), grouped sigmoid routing with a
    # correction bias (perturbed), a shared expert, the first layer dense; then V2-Lite's q_proj, halves rope and
    # yarn with mscale_all_dim (the softmax scale changes), renormalization off.
    "deepseek_v3": dict(arch="deepseek_v3"),
    "deepseek_v3_yarn": dict(
        arch="deepseek_v3", q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, attention_bias=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=512,
                             mscale=1.0, mscale_all_dim=1.0),
    ),
    # DeepSeek-V2-Lite's form (q_proj, complex-pair rope, greedy softmax routing in float32, two shared experts),
    # then V2's group-limited routing with q's low-rank path and a routed scaling factor.
    "deepseek_v2": dict(arch="deepseek_v2"),
    "deepseek_v2_grouped": dict(arch="deepseek_v2", q_lora_rank=64, topk_method="group_limited_greedy", n_group=4,
                                topk_group=2, routed_scaling_factor=2.0),
    # Gemma 3: (1 + w) norms in float32, four norms a layer, q/k norms, scaled embeddings, gelu-tanh, two ropes
    # (sliding-window layers: base 10000; global: 1e6), a window shorter than the prompts; then the tied head (its
    # greedy tokens repeat: random weights) with final logit soft-capping and a linear-scaled global rope.
    "gemma3": dict(arch="gemma3", sliding_window=8),
    "gemma3_tied": dict(
        arch="gemma3", sliding_window=8, tie_word_embeddings=True, final_logit_softcapping=30.0,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
    ),
    # gpt-oss: attention sinks, sliding-window and full layers alternating (a window shorter than the prompts), q/k/v/o
    # biases, a router with a bias and a softmax over its top-k logits, clamped-SwiGLU experts with biases, yarn rope.
    "gpt_oss": dict(arch="gpt_oss", sliding_window=8),
    # A non-default rope whose cos/sin are scaled (attention factor != 1).
    "llama_yarn": dict(
        arch="llama",
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=512),
    ),
}
PROMPT_LENS = (13, 21, 7)
NEW_TOKENS = 8
TIE_GAP = 1e-4  # PARITY.md: a divergence is acceptable only where the reference's top-2 logits are this close


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name, **build_args) -> directory, built once per module."""
    built = {}

    def get(name, **kwargs):
        if name not in built:
            built[name] = build_tiny_model(tmp_path_factory.mktemp(name), **kwargs)
            perturb(built[name])
        return built[name]

    return get


@pytest.fixture(scope="module")
def pair(checkpoint):
    """pair(variant) -> (our fp32 model, transformers' fp32 model) of the same checkpoint."""
    models = {}

    def get(variant):
        if variant not in models:
            path = checkpoint(variant, **VARIANTS[variant])
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            models[variant] = (CausalLM.from_pretrained(path, dtype="float32"), hf)
        return models[variant]

    return get


def _prompts(vocab_size, lens=PROMPT_LENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen) for n in lens]


def _scattered_tables(need, num_blocks, seed=0, groups=1):
    """Block tables drawn from a shuffled pool, so no sequence's blocks are contiguous or ordered: per sequence, one
    per KV layer group."""
    pool = list(range(num_blocks * groups))
    random.Random(seed).shuffle(pool)
    return [tuple([pool.pop() for _ in range(n)] for _ in range(groups)) for n in need]


def _cache_and_tables(model, need, spare, block_size, seed):
    layout = model.kv_layout(block_size)
    groups = len(layout.groups)
    return KVCache(layout, (sum(need) + spare) * groups), _scattered_tables(need, sum(need) + spare, seed, groups)


def _prefill_logits(model, prompts, block_size=4):
    """One step, one prefill slice per prompt: logits of every position of every prompt."""
    need = [-(-len(p) // block_size) for p in prompts]
    cache, tables = _cache_and_tables(model, need, 3, block_size, seed=0)
    meta = AttentionMetadata.build([SeqSlice(t, 0, len(p)) for t, p in zip(tables, prompts)], block_size, "cpu")
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.cat(prompts), positions, meta, cache))  # (T, vocab)
    return logits.split([len(p) for p in prompts])


def _greedy(model, prompts, new_tokens, chunk=5, block_size=4):
    """Chunked prefill then batched decode over one scattered paged cache; steps mix prefill chunks and decodes."""
    need = [-(-(len(p) + new_tokens) // block_size) for p in prompts]
    cache, tables = _cache_and_tables(model, need, 5, block_size, seed=1)
    tokens = [p.tolist() for p in prompts]
    computed = [0] * len(prompts)
    outs = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outs):
        active = [i for i, o in enumerate(outs) if len(o) < new_tokens]
        takes = [min(chunk, len(tokens[i]) - computed[i]) for i in active]
        slices = [SeqSlice(tables[i], computed[i], n) for i, n in zip(active, takes)]
        ids = sum((tokens[i][computed[i] : computed[i] + n] for i, n in zip(active, takes)), [])
        positions = torch.cat([torch.arange(computed[i], computed[i] + n) for i, n in zip(active, takes)])
        meta = AttentionMetadata.build(slices, block_size, "cpu")
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), positions, meta, cache)  # (T, hidden)
            last = model.compute_logits(hidden[torch.cumsum(torch.tensor(takes), 0) - 1])  # (len(active), vocab)
        for row, (i, n) in enumerate(zip(active, takes)):
            computed[i] += n
            if computed[i] == len(tokens[i]):
                tokens[i].append(int(last[row].argmax()))
                outs[i].append(tokens[i][-1])
    return outs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(pair, checkpoint, variant):
    """Our kernels and wiring against transformers, with the linears unpacked: transformers' own fp32 GEMMs.
    oneDNN's packed GEMMs sum in another order (up to ~1e-4 on these logits, varying with the CPU); they are held to
    F.linear in test_kernels, and the packed model to transformers' tokens below."""
    _, hf = pair(variant)
    ours = CausalLM.from_pretrained(checkpoint(variant, **VARIANTS[variant]), dtype="float32", pack=False)
    prompts = _prompts(ours.spec.vocab_size)
    for prompt, logits in zip(prompts, _prefill_logits(ours, prompts)):
        with torch.inference_mode():
            ref = hf(prompt[None]).logits[0].float()  # (n, vocab)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_generate(pair, variant):
    ours, hf = pair(variant)
    prompts = _prompts(ours.spec.vocab_size, seed=1)
    got = _greedy(ours, prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, got):
        ref = hf.generate(
            prompt[None], do_sample=False, max_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True
        )
        expected = ref.sequences[0, len(prompt) :].tolist()
        for j, token in enumerate(expected):  # shorter than ours only if transformers stopped at EOS
            if tokens[j] != token:
                top2 = ref.logits[j][0].float().topk(2).values
                assert top2[0] - top2[1] < TIE_GAP, f"{variant}: token {j} is {tokens[j]}, transformers {token}"
                break


def test_sliding_window_is_per_layer_for_mistral(pair):
    ours, _ = pair("mistral")
    assert ours.spec.sliding_windows == (8,) * ours.spec.num_layers


def test_qwen3_head_dim_and_llama_bias_and_tie(pair):
    qwen3, _ = pair("qwen3")
    assert qwen3.spec.head_dim == 32 != qwen3.spec.hidden_size // qwen3.spec.num_heads and qwen3.spec.qk_norm
    llama, _ = pair("llama")
    assert llama.spec.attention_bias and llama.spec.o_bias and llama.spec.tie_word_embeddings
    assert llama.lm_head.weight is llama.embed_tokens.weight


def test_sharded_checkpoint_loads_same_weights(checkpoint):
    single = checkpoint("plain", arch="llama")
    sharded = checkpoint("sharded", arch="llama", max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = _prompts(4096, lens=(6,))
    a = _prefill_logits(CausalLM.from_pretrained(single), prompts)[0]
    b = _prefill_logits(CausalLM.from_pretrained(sharded), prompts)[0]
    assert torch.equal(a, b)
    assert load_spec(single).fingerprint == load_spec(sharded).fingerprint


# Not Mixtral: transformers runs its experts through a grouped matmul (use_experts_implementation) whose bf16 results
# differ from the per-expert matmuls' by an ulp, and bf16 router near-ties then pick other experts in later layers.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bf16_checkpoint_close_to_transformers(checkpoint, arch):
    """bf16 runs natively where the CPU computes it, else on float32-widened packed weights (experts included)."""
    path = checkpoint(f"bf16-{arch}", arch=arch, dtype="bfloat16")
    ours = CausalLM.from_pretrained(path)
    assert ours.dtype == torch.bfloat16 and ours.spec.checkpoint_dtype == "bfloat16"
    assert ours.kv_layout(16).dtype == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt = _prompts(ours.spec.vocab_size, lens=(9,))[0]
    logits = _prefill_logits(ours, [prompt])[0]
    with torch.inference_mode():
        ref = hf(prompt[None]).logits[0].float()
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()  # identical today; bf16 leaves room to drift
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.85


@pytest.mark.parametrize("checkpoint_dtype, device, flags, expected", [
    ("float32", "cpu", {"avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids and later
    ("float32", "cpu", {"avx512f", "avx512_bf16"}, "bfloat16"),  # Cooper Lake, Zen 4
    ("float32", "cpu", {"avx2", "avx512f"}, "float32"),  # bf16 would be emulated: slower than fp32
    ("bfloat16", "cpu", {"avx2"}, "bfloat16"),  # a 16-bit checkpoint always runs as written
    ("float16", "cpu", {"amx_bf16"}, "float16"),
])
def test_auto_dtype_runs_fp32_checkpoints_in_bf16_only_where_the_cpu_computes_it(checkpoint_dtype, device, flags,
                                                                                 expected):
    assert auto_dtype(checkpoint_dtype, device, frozenset(flags)) == expected


def test_dtype_auto_loads_what_auto_dtype_says_and_none_the_checkpoints(checkpoint):
    path = checkpoint("fp32", arch="llama")
    assert CausalLM.from_pretrained(path).dtype == torch.float32  # None: as transformers loads it
    expected = auto_dtype("float32", "cpu")
    assert str(CausalLM.from_pretrained(path, dtype="auto").dtype) == f"torch.{expected}"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_refused(checkpoint, tmp_path):
    path = _copy(checkpoint("plain", arch="llama"), tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config["architectures"], config["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        CausalLM.from_pretrained(path)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint("plain", arch="llama"), tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        CausalLM.from_pretrained(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint("plain", arch="llama"), tmp_path / "shape")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        CausalLM.from_pretrained(path)


def test_fingerprint_tells_checkpoints_apart(checkpoint):
    plain = checkpoint("plain", arch="llama")
    assert load_spec(plain).fingerprint == load_spec(plain).fingerprint
    other_seed = checkpoint("seed1", arch="llama", seed=1)
    other_arch = checkpoint("qwen2", **VARIANTS["qwen2"])
    fingerprints = {load_spec(p).fingerprint for p in (plain, other_seed, other_arch)}
    assert len(fingerprints) == 3


def test_special_ids_and_eos_union(checkpoint, tmp_path):
    path = _copy(checkpoint("plain", arch="llama"), tmp_path / "eos")
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 5]
    (path / "generation_config.json").write_text(json.dumps(gen))
    spec = load_spec(path)
    assert spec.eos_token_ids == (1, 5) and spec.bos_token_id == 0 and spec.pad_token_id == 2
