"""The C++ CPU kernels and the packed linears against their torch reference path (engine/model/kernels.py TorchOps)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import AttentionMetadata, SeqSlice
from engine.config import this_cpu_flags
from engine.model.kernels import REFERENCE, CpuKernelOps, cpu_kernels, select_ops
from engine.kv.kv_cache import KVCache, KVLayout
from engine.model.causal_lm import CausalLM
from engine.model.linear import Linear, can_pack
from raypd.tools.tiny import build_tiny_model

DTYPES = [torch.float32, torch.bfloat16]
# fp32: only summation order differs. bf16: results are rounded where the reference rounds, so most elements are
# identical and the rest one bf16 step apart (a reduction summed in another order lands on the other side).
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.fixture(scope="module")
def kernels() -> CpuKernelOps:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine runs the torch reference path")
    module = cpu_kernels()
    assert module is not None, "a C++ compiler is present, yet the kernels did not build (see the logged warning)"
    return CpuKernelOps(module)


def _close(ours, ref, dtype):
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (ours == ref).float().mean() > 0.97, "bf16 kernel should round like the reference almost everywhere"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [384, 100])  # 100: a tail past the last full 16-lane vector
def test_rms_norm_and_residual_add(kernels, dtype, width):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=gen).to(dtype)
    residual = torch.randn(7, width, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(width, generator=gen)).to(dtype)
    _close(kernels.rms_norm(x.clone(), weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6), dtype)
    ref_sum, ref_norm = REFERENCE.add_rms_norm(x, residual, weight, 1e-6)
    ours_x = x.clone()
    ours_sum, ours_norm = kernels.add_rms_norm(ours_x, residual, weight, 1e-6)
    assert torch.equal(ours_sum, ref_sum) and ours_sum.data_ptr() == ours_x.data_ptr()  # summed in place
    _close(ours_norm, ref_norm, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1024, 72])
def test_silu_and_mul(kernels, dtype, inter):
    gate_up = (4 * torch.randn(9, 2 * inter, generator=torch.Generator().manual_seed(1))).to(dtype)
    _close(kernels.silu_and_mul(gate_up), REFERENCE.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 48)])
def test_rope_in_place(kernels, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(2)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(t, 1, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ref = REFERENCE.rope(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    ours = kernels.rope(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    for a, b in zip(ours, ref):
        # each product rounded, then the sum, as torch does: never fused into one multiply-add, whatever the CPU
        assert torch.equal(a, b)


def _scattered(needs: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    return [[pool.pop() for _ in range(n)] for n in needs]


# (start, num_new) per sequence: decodes at block edges, a context of one token, prefill chunks from 0 and from
# the middle of a block (chunked prefill, a prefix-cache hit), and contexts that are not multiples of 16.
STEP = [(0, 1), (15, 1), (16, 1), (37, 1), (130, 1), (0, 9), (21, 6), (64, 1), (200, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (14, 2, 64), (4, 4, 32), (6, 3, 48), (8, 2, 64),
                                                     (4, 2, 256)])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_against_reference(kernels, dtype, heads, kv_heads, head_dim, window):
    block_size, gen = 16, torch.Generator().manual_seed(3)
    needs = [-(-(start + n) // block_size) for start, n in STEP]
    layout = KVLayout(2, kv_heads, head_dim, block_size, str(dtype).removeprefix("torch."))
    cache = KVCache(layout, sum(needs) + 4)
    cache.arena.copy_(torch.randn(cache.arena.shape, generator=gen))  # earlier tokens' keys and values
    tables = _scattered(needs, cache.num_blocks, seed=4)
    meta = AttentionMetadata.build([SeqSlice((t,), s, n) for t, (s, n) in zip(tables, STEP)], block_size, "cpu")
    t = meta.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen).to(dtype)
    ref_cache = cache.arena.clone()
    k_ref, v_ref = ref_cache[:, 1, 0], ref_cache[:, 1, 1]  # layer 1: views with the arena's real strides
    ref = REFERENCE.paged_attention(q, kv[:, 0], kv[:, 1], k_ref, v_ref, meta, head_dim**-0.5, window)
    ours = kernels.paged_attention(q, kv[:, 0], kv[:, 1], *cache.layer(1), meta, head_dim**-0.5, window)
    assert torch.equal(cache.arena, ref_cache), "the kernel wrote other cache slots than the reference"
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    if dtype != torch.float32:
        # SDPA rounds its probabilities to bf16 before multiplying the values; the kernel keeps them in fp32. So
        # hold both to the fp32 answer: the kernel must be at least as close to it.
        exact_cache = ref_cache.float()
        exact = REFERENCE.paged_attention(q.float(), kv[:, 0].float(), kv[:, 1].float(), exact_cache[:, 1, 0],
                                          exact_cache[:, 1, 1], meta, head_dim**-0.5, window)
        assert (ours.float() - exact).abs().mean() <= (ref.float() - exact).abs().mean() * 1.05


def _has(flag: str) -> bool:
    return flag in this_cpu_flags()


# Prompt chunks that fill several 16-token tiles and end mid-tile, from 0 and after a cached prefix (mid-block).
PREFILL_STEP = [(0, 345), (100, 70), (5, 16), (0, 33), (250, 1)]


PREFILL_SHAPES = [(4, 2, 64), (14, 2, 64), (8, 8, 128), (6, 2, 96), (4, 2, 32), (2, 1, 256)]


def _prefill_case(kernels, heads: int, kv_heads: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PREFILL_STEP's chunks through the kernels and through the reference: (ours, theirs); the cache is unchanged
    but for the chunks' own keys and values."""
    block_size, gen = 16, torch.Generator().manual_seed(5)
    needs = [-(-(start + n) // block_size) for start, n in PREFILL_STEP]
    layout = KVLayout(1, kv_heads, head_dim, block_size, str(dtype).removeprefix("torch."))
    cache = KVCache(layout, sum(needs) + 2)
    cache.arena.copy_(torch.randn(cache.arena.shape, generator=gen))
    meta = AttentionMetadata.build([SeqSlice((t,), s, n) for t, (s, n) in
                                    zip(_scattered(needs, cache.num_blocks, seed=6), PREFILL_STEP)], block_size, "cpu")
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen).to(dtype)
    kv = torch.randn(meta.num_tokens, 2, kv_heads, head_dim, generator=gen).to(dtype)
    ref_cache = cache.arena.clone()
    ref = REFERENCE.paged_attention(q, kv[:, 0], kv[:, 1], ref_cache[:, 0, 0], ref_cache[:, 0, 1], meta,
                                    head_dim**-0.5, None)
    ours = kernels.paged_attention(q, kv[:, 0], kv[:, 1], *cache.layer(0), meta, head_dim**-0.5, None)
    assert torch.equal(cache.arena, ref_cache)
    if dtype != torch.float32:
        exact_cache = ref_cache.float()
        exact = REFERENCE.paged_attention(q.float(), kv[:, 0].float(), kv[:, 1].float(), exact_cache[:, 0, 0],
                                          exact_cache[:, 0, 1], meta, head_dim**-0.5, None)
        # both round the probabilities and the output to bf16: as close to the fp32 answer as SDPA, give or take
        assert (ours.float() - exact).abs().mean() <= (ref.float() - exact).abs().mean() * 1.1
    return ours, ref


@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", PREFILL_SHAPES)
def test_bf16_prefill_attention_against_reference(kernels, heads, kv_heads, head_dim, tiles, monkeypatch):
    if tiles and not _has("amx_bf16"):
        pytest.skip("this CPU has no AMX-BF16: bf16 prefill attention runs on VDPBF16PS (the other case)")
    if not _has("avx512_bf16") or not _has("avx512bw"):
        pytest.skip("this CPU has no AVX512-BF16: bf16 prefill attention runs torch's SDPA")
    assert kernels.k.prefill_available(), "the CPU has AVX512-BF16 but the kernel was built without it"
    monkeypatch.setattr(kernels, "prefill_tiles", tiles)
    ours, ref = _prefill_case(kernels, heads, kv_heads, head_dim, torch.bfloat16)
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("heads,kv_heads,head_dim", PREFILL_SHAPES + [(3, 1, 16), (4, 4, 48)])
def test_f32_prefill_attention_against_reference(kernels, heads, kv_heads, head_dim):
    if _has("avx512f") or not (_has("avx2") and _has("fma") and _has("f16c")):
        pytest.skip("fp32 prefill attention has its own kernel only on CPUs with AVX2 + FMA and no AVX-512 (SDPA "
                    "elsewhere)")
    assert kernels.k.prefill_f32_available(), "the CPU has AVX2 + FMA but the kernel was built without them"
    assert kernels._prefill_in_place(torch.empty(1, heads, head_dim), None)
    ours, ref = _prefill_case(kernels, heads, kv_heads, head_dim, torch.float32)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


def test_decode_attention_refuses_a_context_longer_than_its_table(kernels):
    cache = KVCache(KVLayout(1, 2, 64, 16, "float32"), 4)
    meta = AttentionMetadata.build([SeqSlice(([0, 1],), 20, 1)], 16, "cpu")
    batch = meta.decode_batch
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="keys for a table of"):
        kernels.k.decode_attention(torch.empty_like(q), q, *cache.layer(0), batch.tables[:, :1], batch.rows,
                                   batch.context_lens, 0, 1.0)


def _random_linear(dtype, seed: int) -> tuple[Linear, list[torch.Tensor]]:
    """A 96 -> 80 Linear with a bias, random, and inputs of 13 and 100 rows."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(96, 80, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen))
        layer.bias.copy_(torch.randn(80, generator=gen))
    return layer, [torch.randn(rows, 96, generator=gen).to(dtype) for rows in (13, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_f_linear(dtype):
    if not can_pack(dtype, "cpu"):
        pytest.skip(f"this CPU does not run {dtype} matmuls in oneDNN")
    # 13 rows: a decode batch, exact; 100: a prefill chunk, padded to a row bucket (128) and cut back
    layer, xs = _random_linear(dtype, seed=5)
    refs = [F.linear(x, layer.weight, layer.bias) for x in xs]
    layer.pack(free_weight=True)
    assert layer.weight.numel() == 0
    for x, ref in zip(xs, refs):
        got = layer(x)
        assert got.shape == ref.shape and got.is_contiguous()
        torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_linear_is_a_16_bit_matmul_computed_in_float32(dtype):
    """Linear.widen, for a CPU that has no matmul of its own for the dtype: float32 math on exactly widened inputs,
    the output rounded to the dtype; a 16-bit matmul with float32 sums gives the same up to summation order."""
    if not can_pack(torch.float32, "cpu"):
        pytest.skip("no oneDNN float32 matmul here")
    layer, xs = _random_linear(dtype, seed=7)
    wants = [F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype) for x in xs]
    natives = [F.linear(x, layer.weight, layer.bias) for x in xs]  # torch's own 16-bit matmul
    layer.widen(free_weight=True)
    assert layer.weight.numel() == 0 and layer.packed.dtype == torch.float32
    for x, want, native in zip(xs, wants, natives):
        got = layer(x)
        assert got.dtype == dtype and got.shape == want.shape
        _close(got, want, torch.bfloat16)
        torch.testing.assert_close(got.float(), native.float(), **TOL[torch.bfloat16])


def test_a_16_bit_model_widens_its_linears_only_where_the_cpu_lacks_the_matmul(tiny_dir):
    model = CausalLM.from_pretrained(tiny_dir, dtype="bfloat16")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    native = can_pack(torch.bfloat16, "cpu")
    assert all(m.packed is not None for m in linears)
    assert all(m.narrow is (None if native else torch.bfloat16) for m in linears)
    assert model.lm_head.weight is model.embed_tokens.weight and model.embed_tokens.weight.numel() > 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kernels-model"), arch="qwen2", tie_word_embeddings=True)


def _steps(model, prompts, forced=None, steps=4, block_size=4):
    """A prefill step, then decode steps; each appends the given tokens, or else the greedy ones. -> (logits per
    step (len(prompts), vocab), the tokens appended)."""
    cache = KVCache(model.kv_layout(block_size), 16)
    tables = _scattered([6, 3], 16, seed=6)
    tokens, chosen, out = [list(p) for p in prompts], [], []
    for step in range(steps):
        starts = [0] * len(tokens) if step == 0 else [len(t) - 1 for t in tokens]
        meta = AttentionMetadata.build([SeqSlice((tb,), s, len(t) - s) for tb, s, t in zip(tables, starts, tokens)],
                                       block_size, "cpu")
        ids = torch.tensor(sum((t[s:] for s, t in zip(starts, tokens)), []))
        pos = torch.cat([torch.arange(s, len(t)) for s, t in zip(starts, tokens)])
        last = torch.tensor([len(tokens[0]) - starts[0] - 1, meta.num_tokens - 1])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, meta, cache)[last])  # (2, vocab)
        out.append(logits)
        picks = forced[step] if forced else logits.argmax(-1).tolist()
        chosen.append(picks)
        for t, token in zip(tokens, picks):
            t.append(token)
    return out, chosen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_kernels_match_reference(kernels, tiny_dir, dtype):
    """Prefill then decode steps through both paths, on the same tokens: the kernels' logits follow the
    reference's (fp32 within summation order; bf16 within its rounding)."""
    fast = CausalLM.from_pretrained(tiny_dir, dtype=dtype)
    slow = CausalLM.from_pretrained(tiny_dir, dtype=dtype, ops=REFERENCE, pack=False)
    assert fast.ops.name == "cpu-kernels" and slow.ops.name == "torch"
    assert fast.lm_head.weight is fast.embed_tokens.weight  # a tied head keeps the table the lookups need
    prompts = [[5, 9, 100, 7, 33, 2000, 41, 8, 77, 15, 16, 17, 99, 1234, 50, 60, 70], [11, 12, 13]]
    ref, tokens = _steps(slow, prompts)
    ours, _ = _steps(fast, prompts, forced=tokens)
    for a, b in zip(ours, ref):
        scale = float(b.abs().max())
        torch.testing.assert_close(a, b, atol=1e-4 if dtype == "float32" else 0.05 * scale, rtol=0)


def test_select_ops_keeps_other_devices_on_the_reference():
    assert select_ops(torch.float32, "meta") is REFERENCE
    assert select_ops(torch.float64, "cpu") is REFERENCE


@pytest.mark.parametrize("vocab", [5, 1000, 4096])
def test_sample_rows_greedy_and_inverse_cdf_draws(kernels, vocab):
    """Greedy rows take the first maximal logit; a sampled row takes the first token whose float64 cumulative
    probability at its temperature exceeds u (up to rounding at the boundary); logprobs are log_softmax's."""
    gen = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(8, vocab, generator=gen)
    logits[0, [1, 3]] = logits[0].max() + 1  # a tie for the maximum: the lower index wins
    if vocab > 20:
        logits[1, [4, 12, 20]] = logits[1].max() + 1  # ties in one vector lane (of 8) and across lanes (of 16)
    logits[5, 2:] = float("-inf")  # two tokens left: nothing else may ever be drawn
    temps = torch.tensor([0.0, 0.0, 1.0, 0.7, 1.5, 1.0, 1.0, 0.05])
    u = torch.tensor([0.0, 0.0, 0.0, 0.31, 0.77, 0.999999, 0.5, 0.9], dtype=torch.float64)
    tokens, logprobs = kernels.k.sample_rows(logits, temps, u)
    for r in range(8):
        t = float(temps[r]) or 1.0
        scaled = logits[r].double() / t
        ref_lp = torch.log_softmax(scaled, dim=-1)
        token = int(tokens[r])
        assert abs(float(logprobs[r]) - float(ref_lp[token])) < 1e-4, r
        if temps[r] == 0:
            assert token == int(logits[r].argmax()), r  # torch's argmax: the first maximum
            continue
        cdf = ref_lp.exp().cumsum(0)
        target = float(u[r]) * float(cdf[-1])
        below = float(cdf[token - 1]) if token else 0.0
        assert below - 1e-6 <= target <= float(cdf[token]) + 1e-6, (r, token, below, target)
        assert torch.isfinite(logits[r, token]), r
    assert int(tokens[0]) == 1
    assert vocab <= 20 or int(tokens[1]) == 4
