"""KV hand-off between engines of different tensor-parallel sizes: each decode rank reads its own heads from the
prefill rank(s) that hold them. First the geometry alone (spans applied to arrays), then real engines: rank processes,
NIXL agents per rank, against colocated tokens."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import signal

import numpy as np
import pytest
import torch

from engine.kv.head_reads import head_reads, head_spans
from engine.kv.kv_cache import KVLayout
from raypd import LLM, DisaggregatedParams, SamplingParams
from tests.engine.images import case, mm
from tests.engine.together import Prestarted, close_together, llms_together, selected, start_each
from tests.pools import wait_pools_full

LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 4, 8, 4


def layout(tp: int, heads: int = HEADS) -> KVLayout:
    per_rank = max(1, heads // tp)
    return KVLayout(LAYERS, per_rank, HEAD_DIM, BLOCK, "float32", tp, heads)


def rank_blocks(whole: torch.Tensor, kv: KVLayout, rank: int) -> torch.Tensor:
    """One rank's pool cut out of a whole-model pool (blocks, layers, 2, block_size, heads, head_dim)."""
    start, stop = kv.rank_heads(rank)
    return whole[..., start:stop, :].contiguous()


def apply(reads_into: torch.Tensor, local: KVLayout, rank: int, remote: KVLayout, remote_pools: list, blocks) -> int:
    """Copies what head_reads/head_spans say, byte by byte, from remote pools into a local one; bytes moved."""
    moved, dst = 0, reads_into.view(torch.uint8).numpy().reshape(reads_into.shape[0], -1)
    for read in head_reads(local, rank, remote):
        src = remote_pools[read.remote_rank].view(torch.uint8).numpy().reshape(remote_pools[0].shape[0], -1)
        if read.whole:
            spans = np.array([[0, local.block_bytes]], dtype=np.uint64)
            remote_spans = local_spans = spans
        else:
            remote_spans, local_spans = head_spans(read, local, rank, remote)
        for remote_block, local_block in blocks:
            for (r_off, length), (l_off, _) in zip(remote_spans.tolist(), local_spans.tolist()):
                dst[local_block, l_off:l_off + length] = src[remote_block, r_off:r_off + length]
                moved += length
    return moved


@pytest.mark.parametrize("prefill_tp, decode_tp, heads", [(2, 1, 4), (1, 2, 4), (2, 2, 4), (4, 2, 4), (2, 4, 4),
                                                          (4, 1, 2), (1, 4, 2), (4, 4, 2)])
def test_each_decode_rank_reads_exactly_its_heads(prefill_tp, decode_tp, heads):
    """Whatever the two splits (more ranks than heads included: a replicated head is read once per rank that holds
    it), each decode rank ends with exactly its heads of the prefill side's blocks, and reads nothing else."""
    whole = torch.randn(6, LAYERS, 2, BLOCK, heads, HEAD_DIM)
    remote, local = layout(prefill_tp, heads), layout(decode_tp, heads)
    pools = [rank_blocks(whole, remote, r) for r in range(prefill_tp)]
    blocks = [(5, 0), (1, 3), (2, 2)]  # (prefill block, decode block)
    for rank in range(decode_tp):
        got = torch.full((4, LAYERS, 2, BLOCK, local.num_kv_heads, HEAD_DIM), float("nan"))
        moved = apply(got, local, rank, remote, pools, blocks)
        want = rank_blocks(whole, local, rank)
        for remote_block, local_block in blocks:
            assert torch.equal(got[local_block], want[remote_block]), (prefill_tp, decode_tp, rank)
        assert moved == len(blocks) * local.block_bytes  # its heads, once each
    assert all(r.whole for r in head_reads(local, 0, remote)) == (prefill_tp == decode_tp)


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, n=2, seed=3, ignore_eos=True)
# 8 MiB of KV per engine (thousands of tokens of these models), not the default 512: each rank allocates and
# registers its share with NIXL at start, which a test's few prompts never fill.
CONFIG = dict(block_size=4, dtype="float32", num_threads=1, kv_transfer="nixl", kv_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def engines(model_factory):
    """One engine of each size, exchanging KV: the TP1 one is also the colocated reference."""
    model = model_factory("llama")
    with llms_together(lambda: LLM(model, **CONFIG), lambda: LLM(model, tensor_parallel_size=2, **CONFIG),
                       lambda: LLM(model, tensor_parallel_size=2, **CONFIG)) as (tp1, tp2a, tp2b):
        yield {"tp1": tp1, "tp2a": tp2a, "tp2b": tp2b}


def hand_off(ctx: LLM, gen: LLM, prompt, params: SamplingParams):
    c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    dp = c.disaggregated_params
    dp.request_type = "generation_only"
    return gen.generate(prompt, params, disaggregated_params=dp)


@pytest.mark.parametrize("prefill, decode", [("tp2a", "tp1"), ("tp1", "tp2a"), ("tp2a", "tp2b")],
                         ids=["P2-D1", "P1-D2", "P2-D2"])
def test_handoff_across_tp_gives_colocated_tokens_and_reads_each_head_once(engines, prefill, decode):
    """Greedy and seeded n=2, then the same prompt again: the decode side holds its first blocks and reads only the
    last, partial one (on every rank). Bytes read are the whole model's KV of the blocks read, once."""
    ctx, gen, reference = engines[prefill], engines[decode], engines["tp1"]
    model_block_bytes = reference.engine.kv_cache.layout.block_bytes
    for k, params in enumerate([GREEDY, SEEDED]):
        shift = k * 101 + sorted(engines).index(prefill) * 7 + sorted(engines).index(decode) * 29
        prompt = [7 + (i * 37 + shift) % 3000 for i in range(30)]  # 7 blocks + 2, new to both engines
        salted = dataclasses.replace(params, cache_salt="reference")  # leaves the decode side's prefix cache cold
        want = [o.token_ids for o in reference.generate(prompt, salted).outputs]
        for read_blocks in (8, 1):
            before = gen.engine.connector.stats().kv_bytes_read
            got = hand_off(ctx, gen, prompt, params)
            assert [o.token_ids for o in got.outputs] == want, (prefill, decode, read_blocks)
            assert gen.engine.connector.stats().kv_bytes_read - before == read_blocks * model_block_bytes
            assert gen.engine.stats()["num_reprefills"] == 0
    wait_pools_full(ctx, gen)


def kv_bytes_per_token(model_dir: str) -> int:
    """From config.json alone: an MLA model caches a latent per layer (kv_lora_rank + qk_rope_head_dim), any other
    keys and values of its KV heads (float32 here)."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    if "kv_lora_rank" in config:
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]  # Mixtral: null
        per_layer = 2 * config["num_key_value_heads"] * head_dim
    return config["num_hidden_layers"] * per_layer * 4


MOE_AND_LATENT = ["deepseek_v3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def moe_and_latent(request, model_factory):
    """arch -> (a TP2 prefill LLM, a TP1 decode LLM) of it, for the test to take (and shut down); every selected
    arch's pair starts in the background when the first is asked for."""
    archs = selected(request, test_moe_and_latent_models_hand_off_from_two_prefill_ranks_to_one, "arch", MOE_AND_LATENT)

    def pair(model):
        return start_each([lambda: LLM(model, tensor_parallel_size=2, **CONFIG), lambda: LLM(model, **CONFIG)],
                              lambda llm: llm.shutdown())

    started = Prestarted({arch: functools.partial(pair, model_factory(arch)) for arch in archs},
                         lambda llms: close_together(llms, lambda llm: llm.shutdown()))
    yield started
    started.close()


@pytest.mark.parametrize("arch", MOE_AND_LATENT)
def test_moe_and_latent_models_hand_off_from_two_prefill_ranks_to_one(model_factory, moe_and_latent, arch):
    """DeepSeek-V3 (its latent cache whole on each prefill rank: read once, from rank 0), Qwen3-MoE and Mixtral (KV
    heads split over the prefill ranks, every expert's width sharded): P TP2 -> D TP1 gives colocated tokens, greedy
    and seeded n=2; the same prompt again reads only its last block. The bytes read per token are the model's KV per
    token: for MLA its latents."""
    model = model_factory(arch)
    ctx, gen = llms = moe_and_latent.take(arch)
    try:
        block_bytes = 4 * kv_bytes_per_token(model)
        assert gen.engine.kv_cache.layout.block_bytes == block_bytes
        for k, params in enumerate([GREEDY, SEEDED]):
            prompt = [7 + (i * 41 + k * 97) % 3000 for i in range(30)]  # 7 blocks + 2
            want = [o.token_ids for o in gen.generate(prompt, dataclasses.replace(
                params, cache_salt="reference")).outputs]
            for read_blocks in (8, 1):
                before = gen.engine.connector.stats().kv_bytes_read
                assert [o.token_ids for o in hand_off(ctx, gen, prompt, params).outputs] == want, (arch, read_blocks)
                assert gen.engine.connector.stats().kv_bytes_read - before == read_blocks * block_bytes
        assert gen.engine.stats()["num_reprefills"] == 0
        wait_pools_full(ctx, gen)
    finally:
        close_together(llms, lambda llm: llm.shutdown())


def test_the_handle_and_card_name_every_prefill_rank(engines):
    card = engines["tp2a"].engine.card()
    assert card.layout.tp_size == 2 and card.layout.model_kv_heads == 2 and len(card.rank_transport_infos) == 1
    assert engines["tp1"].engine.card().rank_transport_infos == ()


def test_a_dead_prefill_rank_makes_the_decode_side_prefill_itself(model_factory, engines):
    """A prefill engine's rank 1 is killed after its prompt was prefilled: decode's read of rank 1's heads fails,
    named, and the decode engine computes the prompt itself; the tokens are the colocated ones."""
    model = model_factory("llama")
    gen, reference = engines["tp1"], engines["tp1"]
    prompt = [11 + (i * 53) % 3000 for i in range(18)]
    want = [o.token_ids for o in reference.generate(prompt, GREEDY).outputs]
    with LLM(model, tensor_parallel_size=2, **CONFIG) as ctx:
        c = ctx.generate(prompt, GREEDY, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        os.kill(ctx.engine.ranks._members.procs[1].pid, signal.SIGKILL)
        ctx.engine.ranks._members.procs[1].wait(10)
        dp = c.disaggregated_params
        dp.request_type = "generation_only"
        before = gen.engine.stats()["num_reprefills"]
        got = gen.generate(prompt, GREEDY, disaggregated_params=dp)
        assert [o.token_ids for o in got.outputs] == want
        assert gen.engine.stats()["num_reprefills"] == before + 1


def test_a_prompt_with_images_hands_off_from_two_prefill_ranks_to_one_decode_rank(llava_factory):
    """LLaVA: the image rows are spliced on both prefill ranks; the decode engine (one rank, the text prompt only)
    reads both ranks' heads and continues as one colocated rank would. Greedy and seeded n=2."""
    model = str(llava_factory())
    text, images = case("two")
    with llms_together(lambda: LLM(model, tensor_parallel_size=2, **CONFIG),
                       lambda: LLM(model, **CONFIG)) as (ctx, gen):
        for params in (GREEDY, SEEDED):
            want = [o.token_ids for o in gen.generate(mm(text, images), dataclasses.replace(
                params, cache_salt="reference")).outputs]
            c = ctx.generate(mm(text, images), params,
                             disaggregated_params=DisaggregatedParams(request_type="context_only"))
            dp = c.disaggregated_params
            dp.request_type = "generation_only"
            got = gen.generate({"prompt": text}, params, disaggregated_params=dp)
            assert [o.token_ids for o in got.outputs] == want
        assert gen.engine.stats()["num_reprefills"] == 0
        wait_pools_full(ctx, gen)
