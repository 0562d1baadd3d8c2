"""The tiny checkpoint builder: loadable by Hugging Face, deterministic, real BPE tokenizer."""

import hashlib
import json
import pathlib
import subprocess
import sys
import unicodedata

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from raypd.tools import tiny

REPO = pathlib.Path(__file__).resolve().parents[2]
CJK, EMOJI = "你好世界", "🙂🚀"
TEXTS = ["café naïve résumé", f"{CJK} {EMOJI}", "Привет, мир! αβγ 👋🏽", "  two  spaces\n\ttab . ,", "🇫🇷日本語"]


def sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """build(name, **kwargs) -> checkpoint dir, built once per name for the module."""
    cache = {}

    def build(name, **kwargs):
        if name not in cache:
            cache[name] = tiny.build_tiny_model(tmp_path_factory.mktemp(name), **kwargs)
        return cache[name]

    return build


@pytest.fixture(scope="module")
def tokenizer(built):
    return AutoTokenizer.from_pretrained(built("llama", arch="llama"))


@pytest.mark.parametrize("arch", tiny.ARCHITECTURES)
def test_each_arch_loads_with_transformers(built, arch):
    path = built(arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)  # Gemma 3's text-only model_type
    assert cfg.vocab_size == len(tok) == model.get_input_embeddings().num_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    # AutoTokenizer picks a class per model_type (Qwen2Tokenizer for qwen2, rebuilding its own
    # pipeline); every one must still be the tokenizer that was built.
    built_tok = tiny.build_tokenizer(tiny.SIZES["tiny"].vocab_size)
    assert all(tok.encode(t) == built_tok.encode(t) for t in TEXTS + ["don't 3.14 <|user|>"])
    ids = torch.tensor([tok.encode("hello world")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_arch_specific_config(built):
    qwen3 = json.loads((built("qwen3", arch="qwen3") / "config.json").read_text())
    assert qwen3["head_dim"] == qwen3["hidden_size"] // qwen3["num_attention_heads"]
    mistral = json.loads((built("mistral", arch="mistral") / "config.json").read_text())
    assert mistral["sliding_window"] == 4096


def test_generation_config_holds_only_special_ids(built):
    gen = json.loads((built("llama", arch="llama") / "generation_config.json").read_text())
    gen.pop("transformers_version", None)
    assert set(gen) == {"bos_token_id", "eos_token_id", "pad_token_id"}


def test_same_args_give_identical_files(built, tmp_path):
    first = built("llama", arch="llama")
    again = tiny.build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert sha256(first / name) == sha256(again / name), name


def test_seed_changes_weights_not_tokenizer(built, tmp_path):
    first = built("llama", arch="llama")
    other = tiny.build_tiny_model(tmp_path / "seed1", seed=1)
    assert sha256(first / "model.safetensors") != sha256(other / "model.safetensors")
    assert sha256(first / "tokenizer.json") == sha256(other / "tokenizer.json")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_multibyte_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_normalizes_to_nfc(tokenizer):
    decomposed = unicodedata.normalize("NFD", "café")
    assert tokenizer.decode(tokenizer.encode(decomposed)) == "café"


@pytest.mark.parametrize("text", [CJK[0], EMOJI[0], EMOJI[1]])
def test_multibyte_chars_span_several_tokens(tokenizer, text):
    # Each piece alone is an incomplete UTF-8 sequence: what incremental detokenizers must handle.
    ids = tokenizer.encode(text)
    assert len(ids) >= 2
    assert "\ufffd" in tokenizer.decode(ids[:1])


def test_special_tokens_are_single_ids(tokenizer):
    for token in tiny.SPECIAL_TOKENS:
        ids = tokenizer.encode(token)
        assert len(ids) == 1 and tokenizer.decode(ids) == token
    assert tokenizer.encode("plain text")[0] != tokenizer.bos_token_id  # no hidden BOS


def test_chat_template_renders_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi 🙂"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nhi 🙂<|eos|>\n")
    assert text.endswith("<|assistant|>\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not plain.endswith("<|assistant|>\n")


def test_sharded_save_writes_index_and_same_weights(built, tmp_path):
    sharded = tiny.build_tiny_model(tmp_path / "sharded", max_shard_size="1MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    whole = AutoModelForCausalLM.from_pretrained(built("llama", arch="llama")).state_dict()
    parts = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_bf16_build_is_the_fp32_build_rounded(built, tmp_path):
    bf16 = tiny.build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    name = "model.embed_tokens.weight"
    with safe_open(bf16 / "model.safetensors", "pt") as f:
        low = f.get_tensor(name)
    with safe_open(built("llama", arch="llama") / "model.safetensors", "pt") as f:
        high = f.get_tensor(name)
    assert low.dtype == torch.bfloat16 and torch.equal(low, high.to(torch.bfloat16))


def test_overrides_reach_the_config(tmp_path):
    path = tiny.build_tiny_model(
        tmp_path / "o", arch="qwen2", num_hidden_layers=2, tie_word_embeddings=True,
        max_position_embeddings=512, vocab_size=1024)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (2, True)
    assert cfg["max_position_embeddings"] == 512
    assert cfg["vocab_size"] == len(AutoTokenizer.from_pretrained(path)) <= 1024


def test_greedy_logits_are_not_near_ties(built, tokenizer):
    # Near-ties would make greedy outputs flip on float noise and parity tests flaky.
    model = AutoModelForCausalLM.from_pretrained(built("llama", arch="llama"))
    ids = torch.tensor([tokenizer.encode(" ".join(TEXTS) + " the quick brown fox jumps")])
    with torch.no_grad():
        top2 = model(ids).logits[0].topk(2, dim=-1).values  # (seq, 2)
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() >= 0.95


@pytest.mark.parametrize("size, low, high", [("tiny", 3e6, 6e6), ("bench", 15e6, 25e6)])
def test_parameter_counts(size, low, high):
    config, _ = tiny.make_config("llama", size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert low <= sum(p.numel() for p in model.parameters()) <= high


def test_cli_builds_same_checkpoint_in_a_fresh_process(built, tmp_path):
    # A fresh process also proves the BPE trainer does not depend on per-process hash seeds.
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "raypd.tools.tiny", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert str(out) in proc.stdout and "parameters" in proc.stdout
    first = built("llama", arch="llama")
    for name in ("model.safetensors", "tokenizer.json"):
        assert sha256(first / name) == sha256(out / name), name
