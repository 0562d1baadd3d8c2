"""Encoder, prefill and decode as Ray actors (prefill and decode on two Ray nodes), embeddings and KV over NIXL between
them, one owner in the test process: the same greedy tokens as transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import pytest
import ray

from cluster.owner.client import DisaggregatedClient
from cluster.serving.launch import start_workers
from engine.multimodal.encoder import EncoderConfig
from engine.core.engine import EngineConfig
from raypd import LLM, SamplingParams
from tests.cluster.owner.test_disagg_ray import pools_full
from tests.engine.images import PROMPTS, case, mm
from tests.engine.parity import LlavaReference, assert_same_tokens

CONFIG = EngineConfig(block_size=4, num_threads=1)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(llava_factory):
    return str(llava_factory())


@pytest.fixture(scope="module")
def workers(ray_cluster, llava):
    w = start_workers(llava, CONFIG, encoder=EncoderConfig(num_slots=32, num_threads=1))
    yield w
    w.kill()


@pytest.fixture(scope="module")
def client(workers, llava):
    with DisaggregatedClient(workers.prefill, workers.decode, llava, request_timeout_s=60,
                             encoder=workers.encoder) as c:
        yield c


def test_the_three_roles_match_transformers(client, workers, llava):
    ref = LlavaReference(llava)
    cases = [case(name, seed=i) for i, name in enumerate(PROMPTS)]
    got = client.generate([mm(t, i) for t, i in cases], GREEDY, use_tqdm=False, timeout=60)
    for name, (text, images), out in zip(PROMPTS, cases, got):
        tokens, gaps = ref.greedy(text, images, 10)
        assert_same_tokens(out.outputs[0].token_ids, tokens, gaps, name)
    pools_full(workers.prefill + workers.decode)


def test_n_candidates_and_the_encoder_cache(client, workers, llava):
    text, images = case("two", seed=9)
    params = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True)
    with LLM(llava, block_size=4) as embedded:
        ref = embedded.generate(mm(text, images), params)
    first = client.generate(mm(text, images), params, timeout=60)
    encoded = ray.get(workers.encoder[0].stats.remote(), timeout=30)["images_encoded"]
    again = client.generate(mm(text, images), params, timeout=60)
    stats = ray.get(workers.encoder[0].stats.remote(), timeout=30)
    assert stats["images_encoded"] == encoded and stats["encoder_cache_hits"] >= 2  # the second time: no encode
    for out in (first, again):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    assert again.num_cached_tokens > first.num_cached_tokens  # the prefill side's prefix cache, keyed by the images
    pools_full(workers.prefill + workers.decode)
