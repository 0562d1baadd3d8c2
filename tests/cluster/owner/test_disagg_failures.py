"""Failures across Ray actors: a prefill worker dies before its KV is read; two incompatible engines meet."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.serving.launch import start_workers
from engine.core.engine import EngineConfig
from raypd import LLM, SamplingParams
from llmapi.disaggregated_params import DisaggregatedParams
from protocol import Submit

CONFIG = EngineConfig(block_size=4, num_threads=1)


def test_prefill_killed_before_the_read_then_decode_re_prefills_and_keeps_serving(ray_cluster, tiny_llama):
    workers = start_workers(tiny_llama, CONFIG)
    try:
        _kill_prefill_then_decode(workers, tiny_llama)
    finally:
        workers.kill()


def _kill_prefill_then_decode(workers, model_dir: str) -> None:
    prefill, decode = workers.prefill[0], workers.decode[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(model_dir, block_size=4) as llm:
        ref = llm.generate("the prefill worker dies", params)
    ids = ref.prompt_token_ids
    context = DisaggregatedParams(request_type="context_only")
    ctx = ray.get(list(prefill.serve.remote(Submit(1, ids, params, context))), timeout=60)[-1]  # after Accepted
    ray.kill(prefill)  # its NIXL agent dies with it, holding the only copy of the prompt's KV
    dp = ctx.handoff.generation_params()
    start = time.monotonic()
    responses = ray.get(list(decode.serve.remote(Submit(1, ids, params, dp))), timeout=60)[1:]
    assert time.monotonic() - start < CONFIG.kv_transfer_timeout_s + 10
    tokens = [ctx.deltas[0].token_ids[0]] + [t for r in responses for d in r.deltas for t in d.token_ids]
    assert tokens == ref.outputs[0].token_ids
    # the decode worker keeps serving, and its pool is whole again
    again = ray.get(list(decode.serve.remote(Submit(2, ids, params, dp))), timeout=60)[1:]
    assert again[-1].finished
    free, total = ray.get(decode.kv_blocks.remote(), timeout=30)
    assert free == total


def test_incompatible_engines_are_refused_when_they_meet(ray_cluster, tiny_llama, model_factory):
    a = start_workers(tiny_llama, CONFIG, num_prefill=1, num_decode=0)
    b = start_workers(model_factory("qwen3"), CONFIG, num_prefill=0, num_decode=1)
    try:
        card = ray.get(a.prefill[0].card.remote(), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="incompatible") as err:
            ray.get(b.decode[0].meet.remote(card), timeout=60)
        assert "model fingerprint" in str(err.value)
    finally:
        a.kill()
        b.kill()
