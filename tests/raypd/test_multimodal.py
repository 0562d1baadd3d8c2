"""Images through the LLM API: embedded (encode in-process), and encoder -> prefill -> decode as three engines in one
process (embeddings and KV over real NIXL), against transformers' LlavaForConditionalGeneration.generate (fp32).
Also: both caches keyed by the image, the encoder cache's leases and LRU, and every handle that must be refused."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.multimodal.encoder_cache import EncoderCacheFull
from raypd import LLM, DisaggregatedParams, MultimodalEncoder, RequestError, SamplingParams
from tests.engine.images import PROMPTS, case, mm, random_images
from tests.engine.parity import LlavaReference, assert_same_tokens
from tests.pools import wait_pools_full

NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def llava(llava_factory):
    return str(llava_factory())


@pytest.fixture(scope="module")
def ref(llava):
    return LlavaReference(llava)


@pytest.fixture(scope="module")
def llm(llava):
    # A 16-token budget cuts the 16-token images across prefill chunks.
    with LLM(llava, block_size=4, max_num_batched_tokens=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def trio(llava):
    with MultimodalEncoder(llava, num_slots=64) as enc, \
            LLM(llava, block_size=4, kv_transfer="nixl") as ctx, LLM(llava, block_size=4, kv_transfer="nixl") as gen:
        yield enc, ctx, gen


@pytest.fixture(autouse=True)
def pools_back_to_full(request):
    yield
    for name in ("llm", "trio"):
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            wait_pools_full(*(value[1:] if name == "trio" else (value,)))


def three_engines(trio, text: str, images: list, params: SamplingParams):
    """encoder -> prefill (embeddings read over NIXL) -> decode (KV read over NIXL); the decode side gets the text
    prompt only."""
    enc, ctx, gen = trio
    e = enc.generate(mm(text, images))
    c = ctx.generate({"prompt": text}, params, disaggregated_params=e.disaggregated_params)
    dp = c.disaggregated_params
    assert dp.multimodal_embedding_handles is None  # decode never sees them
    dp.request_type = "generation_only"
    return e, c, gen.generate({"prompt": text}, params, disaggregated_params=dp)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_embedded_matches_transformers(llm, ref, name):
    text, images = case(name)
    got = llm.generate(mm(text, images), GREEDY)
    tokens, gaps = ref.greedy(text, images, NEW_TOKENS)
    assert_same_tokens(got.outputs[0].token_ids, tokens, gaps, name)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_encoder_prefill_decode_match_transformers(trio, ref, name):
    text, images = case(name, seed=1)
    e, c, g = three_engines(trio, text, images, GREEDY)
    assert len(e.disaggregated_params.multimodal_embedding_handles) == len(images)
    tokens, gaps = ref.greedy(text, images, NEW_TOKENS)
    assert c.outputs[0].token_ids == tokens[:1]
    assert_same_tokens(g.outputs[0].token_ids, tokens, gaps, name)
    assert g.prompt_token_ids == c.prompt_token_ids  # the decode side expanded the placeholders as the handle says


def test_n_candidates(llm, trio, ref):
    text, images = case("two", seed=2)
    greedy = llm.generate(mm(text, images), dataclasses.replace(GREEDY, n=2))
    tokens, gaps = ref.greedy(text, images, NEW_TOKENS)
    for out in greedy.outputs:
        assert_same_tokens(out.token_ids, tokens, gaps, "n=2")
    seeded = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    embedded = llm.generate(mm(text, images), seeded)
    _, _, g = three_engines(trio, text, images, seeded)
    assert [o.token_ids for o in g.outputs] == [o.token_ids for o in embedded.outputs]


def test_a_hit_that_ends_before_an_image_splices_it_in_the_suffix(llm, ref):
    # The same text before the image, another image: the hit covers only whole blocks before it, and the image's
    # rows are spliced at their place in the computed suffix.
    llm.generate(mm(*case("one", seed=70)), GREEDY)
    text, images = case("one", seed=71)
    got = llm.generate(mm(text, images), GREEDY)
    offset = llm.images.processor.process(text, images).ranges[0].offset
    assert 0 < got.num_cached_tokens <= offset
    tokens, gaps = ref.greedy(text, images, NEW_TOKENS)
    assert_same_tokens(got.outputs[0].token_ids, tokens, gaps, "suffix")


def test_a_batch_mixes_plain_and_image_prompts(llm, ref):
    (t1, i1), (t2, _) = case("one", seed=3), case("text_only")
    got = llm.generate([mm(t1, i1), t2, {"prompt": t2}], GREEDY, use_tqdm=False)
    for out, (text, images) in zip(got, [(t1, i1), (t2, []), (t2, [])]):
        tokens, gaps = ref.greedy(text, images, NEW_TOKENS)
        assert_same_tokens(out.outputs[0].token_ids, tokens, gaps, text)


def test_preempted_requests_recompute_their_images(llava, ref):
    # Two prompts that cannot both fit: one is preempted and recomputes its prompt, images spliced again.
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    cases = [case("two", seed=4), case("back_to_back", seed=5)]
    with LLM(llava, block_size=4, num_blocks=24, max_num_batched_tokens=16) as small:
        got = small.generate([mm(t, i) for t, i in cases], params, use_tqdm=False)
        assert small.engine.stats()["num_preemptions"] > 0
    for out, (text, images) in zip(got, cases):
        tokens, gaps = ref.greedy(text, images, 30)
        assert_same_tokens(out.outputs[0].token_ids, tokens, gaps, text)


def test_same_text_other_image_no_hit_same_image_hits_both_caches(trio):
    enc, ctx, gen = trio
    text = "<image> caches are keyed by the image, are they?"
    a, b = random_images(2, seed=40)
    ea, ca, ga = three_engines(trio, text, [a], GREEDY)
    eb, cb, gb = three_engines(trio, text, [b], GREEDY)
    assert ea.multimodal_hashes != eb.multimodal_hashes
    assert cb.num_cached_tokens == 0 and gb.num_cached_tokens == 0  # prefill and decode side alike
    assert gb.outputs[0].token_ids != ga.outputs[0].token_ids
    before = enc.stats()
    ec, cc, gc = three_engines(trio, text, [a], GREEDY)
    after = enc.stats()
    assert after["images_encoded"] == before["images_encoded"]  # no second encode
    assert after["encoder_cache_hits"] == before["encoder_cache_hits"] + 1
    assert ec.multimodal_hashes == ea.multimodal_hashes
    assert cc.num_cached_tokens >= 16 and gc.num_cached_tokens >= 16  # the image's blocks, on both sides
    assert gc.outputs[0].token_ids == ga.outputs[0].token_ids


def test_embedded_prefix_cache_is_keyed_by_the_image(llm):
    text = "<image> an embedded prompt, twice"
    a, b = random_images(2, seed=41)
    first = llm.generate(mm(text, [a]), GREEDY)
    other = llm.generate(mm(text, [b]), GREEDY)
    again = llm.generate(mm(text, [a]), GREEDY)
    assert other.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids != other.outputs[0].token_ids


def _wait_released(enc: MultimodalEncoder, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while enc.stats()["encoder_leases"]:
        assert time.monotonic() < deadline, "the reader's release never reached the encoder"
        time.sleep(0.01)


def test_leased_slots_are_never_evicted_and_a_refilled_slot_is_refused(llava, trio):
    _, ctx, _ = trio
    text = "<image> one slot"
    a, b = random_images(2, seed=50)
    with MultimodalEncoder(llava, num_slots=1) as enc:
        ea = enc.generate(mm(text, [a]))
        with pytest.raises(EncoderCacheFull, match="leased"):
            enc.generate(mm(text, [b]))  # a's slot is leased until its reader releases it
        ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=ea.disaggregated_params)
        _wait_released(enc)
        enc.generate(mm(text, [b]))  # now a is evicted for b
        assert enc.stats()["encoder_cache_evictions"] == 1
        with pytest.raises(ValueError, match="evicted"):  # the handle is still signed and in time; the slot is not a
            ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=ea.disaggregated_params)


def test_expired_handle_is_refused(llava, trio):
    _, ctx, _ = trio
    with MultimodalEncoder(llava, num_slots=2, lease_s=0.6) as enc:
        e = enc.generate(mm("<image> late", random_images(1, seed=51)))
        time.sleep(0.7)
        with pytest.raises(ValueError, match="expired"):
            ctx.generate({"prompt": "<image> late"}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)


def test_tampered_or_foreign_handle_is_refused(llava, trio):
    enc, ctx, _ = trio
    text = "<image> forged"
    e = enc.generate(mm(text, random_images(1, seed=52)))
    real = e.disaggregated_params.multimodal_embedding_handles[0]
    signed = bytearray(real.signed)
    signed[-3] ^= 1
    forged = DisaggregatedParams("context_only", multimodal_embedding_handles=[dataclasses.replace(
        real, signed=bytes(signed))])
    with pytest.raises(ValueError, match="signature"):
        ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=forged)
    with MultimodalEncoder(llava, num_slots=2, cluster_key=b"another cluster's key" * 2) as foreign:
        f = foreign.generate(mm(text, random_images(1, seed=52)))
        with pytest.raises(ValueError, match="signature"):
            ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=f.disaggregated_params)
    wrong_hash = DisaggregatedParams("context_only", multimodal_embedding_handles=[real],
                                     multimodal_hashes=[[0] * 8])
    with pytest.raises(ValueError, match=r"multimodal_hashes\[0\]"):
        ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=wrong_hash)
    # the genuine handle still works
    ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)


def test_handles_another_model_or_dtype_made_are_refused(llava_factory, trio):
    _, ctx, _ = trio
    text = "<image> mismatched"
    image = random_images(1, seed=53)
    with MultimodalEncoder(str(llava_factory(text_arch="qwen3", vision="siglip")), num_slots=2) as other:
        e = other.generate(mm(text, image))
        with pytest.raises(ValueError, match="fingerprint"):
            ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)
    with MultimodalEncoder(str(llava_factory()), num_slots=2, dtype="bfloat16") as half:
        e = half.generate(mm(text, image))
        with pytest.raises(ValueError, match="dtype bfloat16"):
            ctx.generate({"prompt": text}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)


def test_placeholder_and_image_counts_must_agree(llm, trio, tiny_llama):
    enc, ctx, _ = trio
    one = random_images(1, seed=54)
    for text, images in [("<image> and <image>", one), ("<image>", one * 2), ("no placeholder", one),
                         ("<image> but no image", [])]:
        with pytest.raises(ValueError, match="placeholder"):
            llm.generate(mm(text, images), ONE_TOKEN)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate("<image> in a plain prompt", ONE_TOKEN)
    e = enc.generate(mm("<image>", one))
    with pytest.raises(ValueError, match="placeholder"):
        ctx.generate({"prompt": "<image> <image>"}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)
    ctx.generate({"prompt": "<image>"}, ONE_TOKEN, disaggregated_params=e.disaggregated_params)  # read, released
    with pytest.raises(ValueError, match="images\\[0\\]: not a decodable image"):
        llm.generate(mm("<image>", [b"not an image"]), ONE_TOKEN)
    with LLM(tiny_llama) as text_only, pytest.raises(ValueError, match="text-only"):
        text_only.generate(mm("<image>", one), ONE_TOKEN)


def test_a_multimodal_decode_whose_kv_read_fails_ends_with_the_reason(llava, trio):
    enc, _, gen = trio
    text, images = case("one", seed=55)
    # A 1 s KV lease is too short to be read (reads need 1 s of margin): the import fails at once.
    with LLM(llava, block_size=4, kv_lease_s=1.0, kv_transfer="nixl") as ctx:
        e = enc.generate(mm(text, images))
        c = ctx.generate({"prompt": text}, GREEDY, disaggregated_params=e.disaggregated_params)
        dp = c.disaggregated_params
        dp.request_type = "generation_only"
        with pytest.raises(RequestError, match="images whose embeddings only the prefill side had"):
            gen.generate({"prompt": text}, GREEDY, disaggregated_params=dp)
