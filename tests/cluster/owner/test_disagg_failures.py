"""Failures across Ray actors: a prefill worker dies before its KV is read (a text prompt re-prefills on the decode
side; an image prompt, which the decode side cannot compute, is served again whole by its owner); two incompatible
engines meet."""

from __future__ import annotations

import os
import time

import pytest
import ray

from cluster.owner.client import DisaggregatedClient
from cluster.serving.launch import start_workers
from engine.core.engine import EngineConfig
from engine.multimodal.encoder import EncoderConfig
from raypd import LLM, SamplingParams
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import RequestDelta
from protocol import Submit
from tests.cluster.owner.test_disagg_ray import pools_full
from tests.cluster.procs import actor_pid
from tests.engine.images import case, mm

CONFIG = EngineConfig(block_size=4, num_threads=1)


def test_prefill_killed_before_the_read_then_decode_re_prefills_and_keeps_serving(ray_cluster, tiny_llama):
    workers = start_workers(tiny_llama, CONFIG)
    try:
        _kill_prefill_then_decode(workers, tiny_llama)
    finally:
        workers.kill()


def _kill_prefill_then_decode(workers, model_dir: str) -> None:
    """A handle naming a dead agent fails at once (UCX reports the peer gone), well inside the transfer deadline."""
    prefill, decode = workers.prefill[0], workers.decode[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(model_dir, block_size=4) as llm:
        ref = llm.generate("the prefill worker dies", params)
    ids = ref.prompt_token_ids
    context = DisaggregatedParams(request_type="context_only")
    pid = actor_pid(prefill)
    ctx = ray.get(list(prefill.serve.remote(Submit(1, ids, params, context))), timeout=60)[-1]  # after Accepted
    ray.kill(prefill)  # its NIXL agent dies with it, holding the only copy of the prompt's KV
    _wait_gone(pid)
    dp = ctx.handoff.generation_params()
    reprefills = ray.get(decode.stats.remote(), timeout=30)["num_reprefills"]
    start = time.monotonic()
    responses = ray.get(list(decode.serve.remote(Submit(1, ids, params, dp))), timeout=60)[1:]
    assert time.monotonic() - start < CONFIG.kv_transfer_timeout_s / 2  # failed fast, not at the deadline
    assert ray.get(decode.stats.remote(), timeout=30)["num_reprefills"] == reprefills + 1
    tokens = [ctx.deltas[0].token_ids[0]] + [t for r in responses for d in r.deltas for t in d.token_ids]
    assert tokens == ref.outputs[0].token_ids
    # the decode worker keeps serving, and its pool is whole again
    again = ray.get(list(decode.serve.remote(Submit(2, ids, params, dp))), timeout=60)[1:]
    assert again[-1].finished
    free, total = ray.get(decode.kv_blocks.remote(), timeout=30)
    assert free == total


class PrefillDiesAtItsHandoff:
    """The owner's roles, except that the prefill worker is killed once its call has streamed the hand-off and ended:
    its NIXL agent, holding the only copy of the prompt's KV, is gone before the decode side reads."""

    def __init__(self, roles, prefill):
        self.roles, self.prefill, self.colocated = roles, prefill, False
        self.pid = actor_pid(prefill)

    async def encode(self, result, images):
        return await self.roles.encode(result, images)

    async def call(self, role, submit):
        handed_off = False
        async for item in self.roles.call(role, submit):
            handed_off = handed_off or (isinstance(item, RequestDelta) and item.handoff is not None)
            yield item
        if handed_off:  # after the call's end: a stream cut short would read as a lost prefill worker instead
            ray.kill(self.prefill)
            _wait_gone(self.pid)  # Ray calls an actor dead before its process (and NIXL agent) has exited


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {timeout} s after ray.kill")


def _image_request(llava_factory, seed: int, image_seed: int):
    """A tiny LLaVA, a seeded n=2 request with two images, and the embedded engine's answer to it."""
    llava = str(llava_factory())
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=seed, ignore_eos=True)
    prompt = mm(*case("two", seed=image_seed))
    with LLM(llava, block_size=4) as embedded:
        return llava, params, prompt, embedded.generate(prompt, params)


def test_an_image_prompt_whose_prefill_dies_before_the_read_is_served_again_whole(ray_cluster, llava_factory):
    llava, params, prompt, ref = _image_request(llava_factory, seed=7, image_seed=5)
    workers = start_workers(llava, CONFIG, encoder=EncoderConfig(num_slots=8, num_threads=1))
    try:
        with DisaggregatedClient(workers.prefill, workers.decode, llava, request_timeout_s=60,
                                 encoder=workers.encoder) as client:
            client.owner.roles = PrefillDiesAtItsHandoff(client.owner.roles, workers.prefill[0])
            start = time.monotonic()
            got = client.generate(prompt, params, timeout=60)
            assert time.monotonic() - start < CONFIG.kv_transfer_timeout_s + 10
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
        assert [o.finish_reason for o in got.outputs] == ["length", "length"]
        assert client.owner.counters["resumed"] == 1
        pools_full(workers.decode)
    finally:
        workers.kill()


class EncoderDiesAfterEncoding:
    """The owner's roles, except that the first encoder worker is killed as soon as it has encoded the request's
    images: the prefill side cannot read the embeddings its handles name."""

    def __init__(self, roles, encoder):
        self.roles, self.encoder, self.colocated = roles, encoder, False
        self.pid = actor_pid(encoder)
        self.killed = False

    async def encode(self, result, images):
        handles = await self.roles.encode(result, images)
        if not self.killed:
            self.killed = True
            ray.kill(self.encoder)
            _wait_gone(self.pid)
        return handles

    def call(self, role, submit):
        return self.roles.call(role, submit)


def test_an_image_prompt_whose_encoder_dies_before_the_prefill_read_is_encoded_again(ray_cluster, llava_factory):
    llava, params, prompt, ref = _image_request(llava_factory, seed=3, image_seed=6)
    workers = start_workers(llava, CONFIG, encoder=EncoderConfig(num_slots=8, num_threads=1), num_encoder=2)
    try:
        with DisaggregatedClient(workers.prefill, workers.decode, llava, request_timeout_s=60,
                                 encoder=workers.encoder) as client:
            roles = client.owner.roles = EncoderDiesAfterEncoding(client.owner.roles, workers.encoder[0])
            got = client.generate(prompt, params, timeout=60)
        assert roles.killed and client.owner.counters["prefill_lost"] == 1  # served whole, encoded again
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
        pools_full(workers.decode + workers.prefill)
    finally:
        workers.kill()


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
