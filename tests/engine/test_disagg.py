"""Disaggregation in one process: two engines, KV over real NIXL, the reference API's pattern."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

from engine.kv.kv_handle import KVHandle
from raypd import LLM, DisaggregatedParams, GuidedDecodingParams, SamplingParams
from tests.pools import wait_pools_full


@pytest.fixture(scope="module")
def pair(tiny_llama):
    with LLM(tiny_llama, block_size=4, kv_transfer="nixl") as ctx, LLM(tiny_llama, block_size=4, kv_transfer="nixl") as gen:
        yield ctx, gen


@pytest.fixture(autouse=True)
def pools_back_to_full(pair):
    yield
    wait_pools_full(*pair)


def disaggregated(ctx: LLM, gen: LLM, prompt, params: SamplingParams):
    c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    dp = c.disaggregated_params
    dp.request_type = "generation_only"
    return c, gen.generate(prompt, params, disaggregated_params=dp)


JSON_SCHEMA = GuidedDecodingParams(json={"type": "object", "properties": {"w": {"type": "string", "maxLength": 6},
                                                                       "n": {"type": "integer", "maximum": 99}},
                                        "required": ["w", "n"], "additionalProperties": False})
PROMPTS = ["The history of the", "café 你好 🙂 naïve", "one two three four five six seven eight nine ten eleven"]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=11, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=1.0, n=2, seed=4, repetition_penalty=1.3, frequency_penalty=1.0,
                   presence_penalty=0.5, min_p=0.05, logit_bias={97: 5.0}, guided_decoding=JSON_SCHEMA),
], ids=["greedy", "seeded", "n3", "penalties_json"])
def test_same_tokens_as_colocated(pair, params):
    ctx, gen = pair
    colocated = ctx.generate(PROMPTS, params, use_tqdm=False)
    for prompt, ref in zip(PROMPTS, colocated):
        c, g = disaggregated(ctx, gen, prompt, params)
        assert c.disaggregated_params.first_gen_tokens == [o.token_ids[0] for o in ref.outputs]
        assert [o.token_ids[:1] for o in c.outputs] == [o.token_ids[:1] for o in ref.outputs]
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in ref.outputs]
        for a, b in zip(g.outputs, ref.outputs):
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
        if params.logprobs:
            assert [len(o.logprobs) for o in g.outputs] == [len(o.logprobs) for o in ref.outputs]
        if params.guided_decoding:  # the prefill side's first token is under the grammar, decode continues it
            assert all(o.finish_reason == "stop" and set(json.loads(o.text)) == {"w", "n"} for o in g.outputs)


def test_forged_or_foreign_handle_is_refused(pair):
    ctx, gen = pair
    params = SamplingParams(max_tokens=4, temperature=0)
    c = ctx.generate("forge", params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    real = c.disaggregated_params.opaque_state
    tampered = bytearray(real)
    tampered[-5] ^= 1
    dp = DisaggregatedParams("generation_only", first_gen_tokens=c.disaggregated_params.first_gen_tokens,
                             opaque_state=bytes(tampered))
    with pytest.raises(ValueError, match="signature"):
        gen.generate("forge", params, disaggregated_params=dp)
    handle = KVHandle.open(real, None)
    foreign = copy.copy(dp)
    foreign.opaque_state = handle.sign(b"another cluster key" * 2)
    with pytest.raises(ValueError, match="signature"):
        gen.generate("forge", params, disaggregated_params=foreign)
    # the genuine handle still works, and frees the prefill side's blocks when read
    dp.opaque_state = real
    assert gen.generate("forge", params, disaggregated_params=dp).finished


def test_expired_lease_is_never_read_and_the_request_re_prefills(tiny_llama):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(tiny_llama, block_size=4, kv_lease_s=1.5, kv_transfer="nixl") as ctx, LLM(tiny_llama, block_size=4, kv_transfer="nixl") as gen:
        ref = ctx.generate("late decode", params)
        c = ctx.generate("late decode", params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        time.sleep(2.0)  # the lease ends; the prefill side frees (and may reuse) the blocks
        wait_pools_full(ctx)
        dp = c.disaggregated_params
        dp.request_type = "generation_only"
        g = gen.generate("late decode", params, disaggregated_params=dp)
        assert g.outputs[0].token_ids == ref.outputs[0].token_ids
        wait_pools_full(ctx, gen)


def test_incompatible_engines_are_refused_at_handshake(model_factory, tiny_llama):
    other = model_factory("qwen2")
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(tiny_llama, block_size=4, kv_transfer="nixl") as ctx, LLM(other, block_size=8, kv_transfer="nixl") as gen:
        c = ctx.generate("hello", params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        dp = c.disaggregated_params
        dp.request_type = "generation_only"
        with pytest.raises(ValueError, match="incompatible") as err:
            gen.generate("hello", params, disaggregated_params=dp)
        assert "model fingerprint" in str(err.value) and "block_size" in str(err.value)


def _drive(engine, request_id: int, timeout: float = 30.0):
    """Steps a bare engine until the request finishes; returns its responses."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += [r for r in engine.step() if r.request_id == request_id]
        if got and got[-1].final:
            return got
    raise AssertionError(f"request {request_id} did not finish")


def test_blocks_reused_during_the_read_are_detected_and_re_prefilled(tiny_llama, caplog):
    from engine.core.engine import EngineConfig, LLMEngine, nixl_connector

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(20, 45))
    config = EngineConfig(block_size=4)
    ctx, gen = (LLMEngine(tiny_llama, config, nixl_connector(config)) for _ in range(2))
    try:
        ctx.add_request(0, prompt, params, DisaggregatedParams(request_type="context_only"))
        dp = _drive(ctx, 0)[-1].handoff.generation_params()
        # The prefill side frees and reuses one of the blocks while the handle is still in flight.
        block = KVHandle.open(dp.opaque_state, None).block_ids[2]
        ctx.block_manager.generations[block] += 1
        gen.add_request(7, prompt, params, dp)
        tokens = [t for r in _drive(gen, 7) for d in r.deltas for t in d.token_ids]
        assert "were reused" in caplog.text
        gen.add_request(8, prompt, params)
        assert tokens == [t for r in _drive(gen, 8) for d in r.deltas for t in d.token_ids]
        _drive_until_free(ctx)
    finally:
        ctx.close()
        gen.close()


def _drive_until_free(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        assert time.monotonic() < deadline, "prefill side did not free the leased blocks"
        engine.step()
        time.sleep(0.01)


def test_dead_prefill_peer_fails_over_to_local_prefill(tiny_llama):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(tiny_llama, block_size=4, kv_transfer="nixl") as gen:
        ctx = LLM(tiny_llama, block_size=4, kv_transfer="nixl")
        ref = ctx.generate("the peer dies", params)
        c = ctx.generate("the peer dies", params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        ctx.shutdown()  # its NIXL agent is gone before the decode side reads
        dp = c.disaggregated_params
        dp.request_type = "generation_only"
        start = time.monotonic()
        g = gen.generate("the peer dies", params, disaggregated_params=dp, timeout=30)
        assert time.monotonic() - start < 15
        assert g.outputs[0].token_ids == ref.outputs[0].token_ids
        wait_pools_full(gen)


def _held(engine) -> int:
    return len(engine.scheduler.held)


def test_forged_foreign_or_replayed_releases_free_nothing(tiny_llama):
    from engine.core.engine import EngineConfig, LLMEngine, nixl_connector
    from engine.kv.kv_handle import release_message

    config = EngineConfig(block_size=4)
    ctx, other = (LLMEngine(tiny_llama, config, nixl_connector(config)) for _ in range(2))
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        leases = []
        for rid in (0, 1):
            ctx.add_request(rid, list(range(20 + rid, 45 + rid)), params, DisaggregatedParams("context_only"))
            leases.append(KVHandle.open(_drive(ctx, rid)[-1].handoff.opaque_state, None).lease_id)
        other.meet(ctx.card())
        send = lambda msg: other.connector.transport.send_notification(ctx.card().name, msg)  # noqa: E731
        send(release_message(leases[0], b"a key of another cluster" * 2))  # foreign (or forged) signature
        send(b"raypd.release.v2:" + leases[0].encode() + b":00")  # a made-up one
        send(release_message("0" * 32, None))  # validly signed, but names no lease
        _wait_for(lambda: ctx.connector.stats().releases_rejected == 2 and ctx.connector.stats().releases_unknown == 1,
                  ctx)
        assert _held(ctx) == 2
        genuine = release_message(leases[0], None)
        send(genuine)
        _wait_for(lambda: _held(ctx) == 1, ctx)
        send(genuine)  # replayed: its lease is gone, and the other lease is not touched
        _wait_for(lambda: ctx.connector.stats().releases_unknown == 2, ctx)
        assert _held(ctx) == 1 and 1 in ctx.scheduler.held
        ctx.abort_request(1)  # an abort after the hand-off ends the lease at once
        assert _held(ctx) == 0 and ctx.connector.stats().leases == 0
        assert ctx.block_manager.num_free_blocks == ctx.block_manager.num_blocks
        ctx.block_manager.check()
    finally:
        ctx.close()
        other.close()


def _wait_for(condition, engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        engine.step()
        time.sleep(0.01)


def test_more_imports_than_seats_wait_in_their_queue(tiny_llama):
    """Six hand-offs to a decode engine with two seats and a small pool: never more than two sequences admitted,
    imports that cannot get blocks wait (holding nothing), and every request gets the tokens it would colocated."""
    from engine.core.engine import EngineConfig, LLMEngine, nixl_connector

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ctx_config, gen_config = EngineConfig(block_size=4), EngineConfig(block_size=4, max_num_seqs=2, num_blocks=20)
    ctx = LLMEngine(tiny_llama, ctx_config, nixl_connector(ctx_config))
    gen = LLMEngine(tiny_llama, gen_config, nixl_connector(gen_config))
    try:
        prompts = [[10 + (7 * i + 3 * j) % 3000 for j in range(25 + i)] for i in range(6)]
        expected, handoffs = {}, {}
        for i, p in enumerate(prompts):
            ctx.add_request(100 + i, p, params)
            expected[i] = [t for r in _drive(ctx, 100 + i) for d in r.deltas for t in d.token_ids]
            ctx.add_request(i, p, params, DisaggregatedParams("context_only"))
            handoffs[i] = _drive(ctx, i)[-1].handoff
        for i, p in enumerate(prompts):
            gen.add_request(i, p, params, handoffs[i].generation_params())
        got = {i: [] for i in handoffs}
        deadline = time.monotonic() + 60
        while gen.has_unfinished_requests():
            assert time.monotonic() < deadline, "the decode engine did not finish"
            ctx.step()  # the prefill side frees each lease when its release arrives
            for rsp in gen.step():
                got[rsp.request_id] += [t for d in rsp.deltas for t in d.token_ids]
            sched = gen.scheduler
            assert len(sched.running) + len(sched.waiting_for_kv) <= 2
            assert all(not s.block_tables for s in sched.waiting)
        assert got == expected
        _drive_until_free(ctx)
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        ctx.close()
        gen.close()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gemma3",
                                  "gpt_oss"])
def test_other_families_hand_off_the_same_tokens_with_decode_side_prefix_hits(model_factory, arch):
    """A mixture-of-experts model's KV is a dense model's (DeepSeek's a block of latents): the hand-off carries it
    unchanged, greedy and seeded, and a decode replica that already holds the prompt reads only its last, partial
    block. Gemma 3's and gpt-oss's sliding-window layers move only the blocks of the window the first decode step
    sees: the bytes read are what config.json's layer types and window say decode needs, layer by layer."""
    model = model_factory(arch, **({"sliding_window": 8} if arch in ("gemma3", "gpt_oss") else {}))
    cases = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, n=2, seed=3, ignore_eos=True)]
    with LLM(model, block_size=4, kv_transfer="nixl") as ctx, LLM(model, block_size=4, kv_transfer="nixl") as gen:
        layout = gen.engine.kv_cache.layout
        for k, params in enumerate(cases):
            prompt = [7 + (i * 37 + k * 101) % 3000 for i in range(30)]  # 7 full blocks + 2 tokens, new per case
            ref = ctx.generate(prompt, params)
            for cached in (0, 7):  # the second time, the decode side holds the first 7 blocks
                before = gen.engine.connector.stats().kv_bytes_read
                _, g = disaggregated(ctx, gen, prompt, params)
                assert [o.token_ids for o in g.outputs] == [o.token_ids for o in ref.outputs]
                expected = _blocks_decode_needs(model, len(prompt), 4, cached) * layout.block_bytes // \
                    layout.block_layers
                assert gen.engine.connector.stats().kv_bytes_read - before == expected
        wait_pools_full(ctx, gen)


def _blocks_decode_needs(model_dir: str, prompt_len: int, block_size: int, cached: int) -> int:
    """One-layer blocks a decode engine holding the prompt's first `cached` blocks reads, from config.json alone:
    every block of a full-attention layer, and of a sliding-window layer those the first decode step's window
    (positions > prompt_len - window) touches."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    types = config.get("layer_types") if config.get("sliding_window") else None
    types = types or ["full_attention"] * config["num_hidden_layers"]
    end = -(-prompt_len // block_size)
    first = {"full_attention": 0,
             "sliding_attention": max(0, prompt_len - (config.get("sliding_window") or 0) + 1) // block_size}
    return sum(end - max(cached, first[t]) for t in types)


def test_a_burst_of_hand_offs_larger_than_the_pool_completes_without_re_reading(tiny_llama):
    """Six 40-token hand-offs (60 blocks) to a decode engine of 40 blocks already decoding two streams: imports wait
    for blocks, every request gets its colocated tokens, and a sequence preempted after its import recomputes its
    prompt (its lease was released once read): it never asks the prefill side for blocks again."""
    from engine.core.engine import EngineConfig, LLMEngine, nixl_connector

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ctx_config, gen_config = EngineConfig(block_size=4), EngineConfig(block_size=4, num_blocks=40)
    ctx = LLMEngine(tiny_llama, ctx_config, nixl_connector(ctx_config))
    gen = LLMEngine(tiny_llama, gen_config, nixl_connector(gen_config))
    try:
        streams = {1000 + i: [10 + (5 * i + j) % 3000 for j in range(12)] for i in range(2)}
        prompts = {i: [10 + (7 * i + 3 * j) % 3000 for j in range(40)] for i in range(6)}
        expected, handoffs = {}, {}
        long = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
        for rid, p in {**streams, **prompts}.items():
            ctx.add_request(rid + 5000, p, long if rid in streams else params)
            expected[rid] = [t for r in _drive(ctx, rid + 5000) for d in r.deltas for t in d.token_ids]
        for rid, p in prompts.items():
            ctx.add_request(rid, p, params, DisaggregatedParams("context_only"))
            handoffs[rid] = _drive(ctx, rid)[-1].handoff
        for rid, p in streams.items():
            gen.add_request(rid, p, long)
        got, queued = {rid: [] for rid in expected}, 0
        for step in range(2000):
            if step == 5:  # the streams are decoding: the burst arrives
                for rid, p in prompts.items():
                    gen.add_request(rid, p, params, handoffs[rid].generation_params())
            ctx.step()
            for rsp in gen.step():
                got[rsp.request_id] += [t for d in rsp.deltas for t in d.token_ids]
            queued = max(queued, gen.stats()["num_waiting_imports"])
            if step > 5 and not gen.has_unfinished_requests():
                break
            time.sleep(0.002)
        assert got == expected
        stats = gen.stats()
        assert stats["num_preemptions"] > 0 and stats["num_reprefills"] == 0
        assert queued > 0 and stats["num_waiting_imports"] == 0  # the queue's depth, as /metrics shows it
        _drive_until_free(ctx)
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        ctx.close()
        gen.close()
