"""The vision tower + projector against transformers' LlavaForConditionalGeneration.get_image_features, and loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import load_spec
from engine.model.causal_lm import CausalLM
from engine.multimodal.vision import VisionEncoder, load_vision_spec

# Each variant exercises one thing transformers does with the config: which hidden states, CLS or not, the projector.
VARIANTS = {
    "clip": dict(vision="clip"),  # layer -2, "default" drops CLS
    "clip_full_last": dict(vision="clip", llava_config=dict(vision_feature_layer=-1,
                                                             vision_feature_select_strategy="full")),
    "clip_layer_list": dict(vision="clip", llava_config=dict(vision_feature_layer=[-3, 1, -1])),
    # -4 of 3 layers is hidden state 0, the encoder's input. (transformers 5.24 fails on vision_feature_layer=0: it
    # passes the 0 on as output_hidden_states, which then reads as False and captures nothing.)
    "clip_input_layer": dict(vision="clip", llava_config=dict(vision_feature_layer=-4, multimodal_projector_bias=False,
                                                               projector_hidden_act="gelu_pytorch_tanh")),
    "siglip": dict(vision="siglip", text_arch="qwen2"),  # layer -1, "full"
    # transformers drops the first position under "default" even where it is a patch, not a CLS token.
    "siglip_default": dict(vision="siglip", llava_config=dict(vision_feature_layer=-2,
                                                               vision_feature_select_strategy="default")),
    # A pooling head in the checkpoint that the features never read.
    "siglip_head": dict(vision="siglip", vision_config=dict(vision_use_head=True)),
    "siglip_list": dict(vision="siglip", llava_config=dict(vision_feature_layer=[-1, -2])),
}


@pytest.fixture(scope="module")
def pair(llava_factory):
    """pair(variant) -> (our VisionEncoder, transformers' LlavaForConditionalGeneration), fp32."""
    cache = {}

    def get(variant):
        if variant not in cache:
            path = llava_factory(**VARIANTS[variant])
            hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
            cache[variant] = (VisionEncoder.from_pretrained(path, dtype="float32"), hf)
        return cache[variant]

    return get


def _pixels(n, side=32, seed=0):
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))  # (N, C, H, W)


def _reference(hf, pixel_values):
    with torch.inference_mode():
        return torch.stack(hf.get_image_features(pixel_values=pixel_values).pooler_output)  # (N, tokens, hidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_features_match_get_image_features(pair, variant):
    ours, hf = pair(variant)
    pixels = _pixels(3)
    with torch.inference_mode():
        got = ours(pixels)
    ref = _reference(hf, pixels)
    assert got.shape == ref.shape == (3, ours.spec.tokens_per_image, hf.config.text_config.hidden_size)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_token_counts_follow_the_strategy(pair):
    assert pair("clip")[0].spec.tokens_per_image == 16  # 17 positions less CLS
    assert pair("clip_full_last")[0].spec.tokens_per_image == 17
    assert pair("siglip")[0].spec.tokens_per_image == 16
    assert pair("siglip_default")[0].spec.tokens_per_image == 15


def test_feature_layer_zero_is_the_encoder_input(llava_factory, pair, tmp_path):
    def layer_zero(config):
        config["vision_feature_layer"] = 0

    path = _edit_config(llava_factory(**VARIANTS["clip_input_layer"]), tmp_path / "zero", layer_zero)
    zero = VisionEncoder.from_pretrained(path)
    pixels = _pixels(2)
    with torch.inference_mode():
        assert torch.equal(zero(pixels), pair("clip_input_layer")[0](pixels))


def test_only_the_layers_read_are_built(pair):
    assert len(pair("clip")[0].vision_tower.encoder.layers) == 2  # layer -2 of 3: the last layer is never read
    assert len(pair("clip_input_layer")[0].vision_tower.encoder.layers) == 0
    assert pair("clip_layer_list")[0].spec.feature_layers == (1, 1, 3)


def test_each_image_is_encoded_alone(pair):
    # Batching images must not mix them: the encoder's output for one image is the same with others beside it.
    ours, _ = pair("siglip")
    pixels = _pixels(3, seed=1)
    with torch.inference_mode():
        together = ours(pixels)
        alone = ours(pixels[1:2])
    torch.testing.assert_close(together[1:2], alone, atol=1e-6, rtol=0)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_hub_layout_with_vision_model_prefix_loads(llava_factory, tmp_path):
    # Checkpoints on the Hub (written by transformers 4.x) keep the tower under vision_tower.vision_model.
    path = _copy(llava_factory(vision="clip"), tmp_path / "hub")
    tensors = load_file(path / "model.safetensors")
    renamed = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in tensors.items()}
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    ours = VisionEncoder.from_pretrained(path)
    assert ours.spec.weight_prefix == "vision_tower.vision_model."
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = _pixels(2)
    with torch.inference_mode():
        torch.testing.assert_close(ours(pixels), _reference(hf, pixels), atol=1e-5, rtol=1e-5)


def test_sharded_llava_loads_the_same(llava_factory, pair):
    sharded = llava_factory(vision="clip", max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    ours, _ = pair("clip")
    other = VisionEncoder.from_pretrained(sharded)
    pixels = _pixels(2)
    with torch.inference_mode():
        assert torch.equal(ours(pixels), other(pixels))
    assert load_spec(sharded).fingerprint == ours.spec.fingerprint


def test_bf16_encoder_is_close(llava_factory, pair):
    _, hf = pair("clip")
    low = VisionEncoder.from_pretrained(llava_factory(**VARIANTS["clip"]), dtype="bfloat16")
    pixels = _pixels(2)
    with torch.inference_mode():
        got = low(pixels).float()
    ref = _reference(hf, pixels)
    assert low.dtype == torch.bfloat16
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_text_part_loads_with_its_spec(llava_factory):
    path = llava_factory(text_arch="qwen3", vision="siglip")
    model = CausalLM.from_pretrained(path)
    spec = model.spec
    raw = json.loads((path / "config.json").read_text())
    assert spec.architecture == "Qwen3ForCausalLM" and spec.qk_norm and spec.weight_prefix == "language_model."
    assert spec.vocab_size == raw["text_config"]["vocab_size"] and spec.hidden_size == 256
    assert spec.eos_token_ids == (1,) and spec.fingerprint == load_vision_spec(path).fingerprint


def test_tied_text_head_loads(llava_factory):
    path = llava_factory(text_arch="llama", vision="clip", tie_word_embeddings=True)
    model = CausalLM.from_pretrained(path)
    assert model.spec.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_text_only_checkpoint_has_no_vision_spec(tiny_llama):
    assert load_vision_spec(tiny_llama) is None
    assert load_spec(tiny_llama).weight_prefix == ""
    with pytest.raises(ValueError, match="text-only"):
        VisionEncoder.from_pretrained(tiny_llama)


def _edit_config(src, dst, edit):
    path = _copy(src, dst)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_unsupported_vision_tower_is_refused_by_name(llava_factory, tmp_path):
    def to_pixtral(config):
        config["vision_config"]["model_type"] = "pixtral"

    path = _edit_config(llava_factory(vision="clip"), tmp_path / "pixtral", to_pixtral)
    with pytest.raises(ValueError, match="'pixtral'.*clip_vision_model, siglip_vision_model"):
        load_vision_spec(path)


def test_unsupported_text_model_is_refused_by_name(llava_factory, tmp_path):
    def to_gemma(config):
        config["text_config"]["model_type"] = "gemma"

    path = _edit_config(llava_factory(vision="clip"), tmp_path / "gemma", to_gemma)
    with pytest.raises(ValueError, match="'gemma'"):
        CausalLM.from_pretrained(path)


def test_other_multimodal_architecture_is_refused(llava_factory, tmp_path):
    def to_next(config):
        config["architectures"] = ["LlavaNextForConditionalGeneration"]

    path = _edit_config(llava_factory(vision="clip"), tmp_path / "next", to_next)
    with pytest.raises(ValueError, match="LlavaNextForConditionalGeneration.*LlavaForConditionalGeneration"):
        load_spec(path)


def test_feature_layer_out_of_range_is_refused(llava_factory, tmp_path):
    def far(config):
        config["vision_feature_layer"] = -5  # 3 layers: 4 hidden states

    path = _edit_config(llava_factory(vision="clip"), tmp_path / "far", far)
    with pytest.raises(ValueError, match="vision_feature_layer -5"):
        load_vision_spec(path)


def test_missing_vision_tensor_is_named(llava_factory, tmp_path):
    path = _copy(llava_factory(vision="clip"), tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["multi_modal_projector.linear_2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_2\.weight"):
        VisionEncoder.from_pretrained(path)
    CausalLM.from_pretrained(path)  # the text part is whole


def test_wrong_image_size_is_refused(pair):
    ours, _ = pair("clip")
    with pytest.raises(ValueError, match="48x48 pixels.*32x32"):
        ours(_pixels(1, side=48))


def test_stray_tensor_is_named(llava_factory, tmp_path):
    path = _copy(llava_factory(vision="siglip"), tmp_path / "stray")
    tensors = load_file(path / "model.safetensors")
    tensors["image_newline"] = torch.zeros(4)  # another architecture's parameter
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected vision tensor.*image_newline"):
        VisionEncoder.from_pretrained(path)
