"""The tiny LLaVA builder: loadable by transformers (model, processor, tokenizer), deterministic, PIL backend."""

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

from raypd.tools import tiny
from tests.engine.images import random_images

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
         "chat_template.jinja", "generation_config.json")


def sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def build(name, **kwargs):
        if name not in cache:
            cache[name] = tiny.build_tiny_model(tmp_path_factory.mktemp(name), arch="llava", **kwargs)
        return cache[name]

    return build


@pytest.mark.parametrize("text_arch", tiny.LLAVA_TEXT_ARCHITECTURES)
@pytest.mark.parametrize("vision", tiny.VISION_TOWERS)
def test_transformers_loads_model_processor_and_generates(built, text_arch, vision):
    path = built(f"{vision}-{text_arch}", text_arch=text_arch, vision=vision)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == f"{'CLIP' if vision == 'clip' else 'Siglip'}ImageProcessorPil"
    cfg = model.config
    assert cfg.text_config.model_type == text_arch and cfg.vision_config.model_type == f"{vision}_vision_model"
    assert processor.image_token_id == cfg.image_token_index == len(processor.tokenizer) - 1
    assert cfg.text_config.vocab_size == len(processor.tokenizer)
    inputs = processor(images=random_images(2), text="a <image> b <image>", return_tensors="pt")
    assert (inputs["input_ids"] == cfg.image_token_index).sum() == 2 * cfg.image_seq_length == 32
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)


def test_same_args_give_identical_files(built, tmp_path):
    first = built("clip-llama", text_arch="llama", vision="clip")
    again = tiny.build_tiny_model(tmp_path / "again", arch="llava")  # the defaults: llama + clip
    for name in FILES:
        assert sha256(first / name) == sha256(again / name), name


def test_text_tokenizes_as_in_the_text_checkpoint(built):
    tok = transformers.AutoTokenizer.from_pretrained(built("clip-llama", text_arch="llama", vision="clip"))
    text_tok = tiny.build_tokenizer(tiny.SIZES["tiny"].vocab_size)
    for text in ("café naïve résumé", "<|user|>\nhello world 🙂", "  two  spaces"):
        assert tok.encode(text) == text_tok.encode(text)
    image = tok.convert_tokens_to_ids(tiny.IMAGE_TOKEN)
    assert tok.encode("a<image>b") == [*tok.encode("a"), image, *tok.encode("b")]
    assert tok.image_token == tiny.IMAGE_TOKEN and tok.decode([image], skip_special_tokens=True) == ""


def test_chat_template_renders_image_parts(built):
    processor = transformers.AutoProcessor.from_pretrained(built("clip-llama", text_arch="llama", vision="clip"))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is "}, {"type": "image"}, {"type": "text", "text": " this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>\nwhat is <image> this?<|eos|>\n<|assistant|>\n"
    plain = [{"role": "user", "content": "hi"}]
    assert processor.tokenizer.apply_chat_template(plain, tokenize=False) == "<|bos|><|user|>\nhi<|eos|>\n"


def test_siglip_keeps_every_patch(built):
    cfg = json.loads((built("siglip-qwen2", text_arch="qwen2", vision="siglip") / "config.json").read_text())
    assert cfg["vision_feature_select_strategy"] == "full" and cfg["vision_feature_layer"] == -1
    assert cfg["vision_config"]["vision_use_head"] is False
    processor = json.loads((built("siglip-qwen2", text_arch="qwen2", vision="siglip") / "processor_config.json")
                           .read_text())
    assert processor["num_additional_image_tokens"] == 0 and processor["patch_size"] == 8


def test_unknown_vision_tower_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown vision tower 'vit'"):
        tiny.build_tiny_model(tmp_path / "x", arch="llava", vision="vit")


def test_parameter_count_stays_test_sized(built):
    assert 4e6 < tiny.num_parameters(built("clip-llama", text_arch="llama", vision="clip")) < 5.5e6


def test_cli_builds_same_checkpoint_in_a_fresh_process(built, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "raypd.tools.tiny", str(out), "--arch", "llava", "--text-arch", "qwen2", "--vision",
         "siglip"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert str(out) in proc.stdout
    first = built("siglip-qwen2", text_arch="qwen2", vision="siglip")
    for name in FILES:
        assert sha256(first / name) == sha256(out / name), name
