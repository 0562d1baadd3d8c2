"""Tiny random-weight Hugging Face checkpoints with a real byte-level BPE tokenizer.

They are the project's default model and the models every test uses: built offline and
deterministically (same arguments -> byte-identical files), in the exact on-disk format of a
real checkpoint (config.json, safetensors, tokenizer.json), so the loader, tokenizer and
detokenizer paths are the ones a real model would take.

    python -m raypd.tools.tiny models/tiny-llama [--arch llama] [--size tiny|bench|0.5b|1b] [--seed 0] [--dtype float32]
    python -m raypd.tools.tiny models/tiny-llava --arch llava [--text-arch llama] [--vision clip|siglip]

A llava checkpoint is LlavaForConditionalGeneration (a tiny CLIP or SigLIP tower, the MLP projector, one of the text
architectures) with the `<image>` token and processor files for the PIL backend, as AutoProcessor loads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import random

import torch
import transformers
from safetensors import safe_open
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAVA_TEXT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # what "llava" wraps
DENSE_ARCHITECTURES = (*LLAVA_TEXT_ARCHITECTURES, "gemma3")
# DeepSeek-V2 and V3: latent attention too; gpt-oss: attention sinks and alternating sliding windows
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES  # text-only
VISION_TOWERS = ("clip", "siglip")

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# UNK is never produced (byte-level BPE covers every byte); it exists because AutoTokenizer
# rebuilds qwen2 tokenizers as Qwen2Tokenizer, which would otherwise add an unk token of its own
# and make len(tokenizer) exceed the model's vocab.
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS, UNK)
# Added after BPE training (id len(vocab)), so a llava checkpoint tokenizes text exactly as the text-only ones do.
IMAGE_TOKEN = "<image>"

# Qwen2's pre-tokenizer regex (single digits, contractions, punctuation runs). AutoTokenizer
# forces Qwen2Tokenizer on qwen2 checkpoints and that class rebuilds the pipeline as NFC + this
# split + ByteLevel, ignoring tokenizer.json's; using the same pipeline for every architecture
# makes all of them load to the tokenizer that was built.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Tools as Hermes / Qwen2.5 templates give them: JSON signatures in <tools>, calls asked for in <tool_call> tags.
TOOLS_PREAMBLE = ("# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
                  "provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_POSTAMBLE = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and "
                   "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
                   "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>")

# Turns end with EOS so that a chat reply stops where generation stops. BOS is written by the
# template (not by the tokenizer's post-processor) so plain completions carry no hidden token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_POSTAMBLE + "' + eos_token + '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\n<tool_response>\n' + message['content'] + '\n</tool_response>' + eos_token + '\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\n' if (message['content'] or not loop.first) else '' }}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# The same turns; content may also be a list of parts (transformers' and OpenAI's), an image part becoming <image>.
MULTIMODAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinySize:
    """Shape of one model size; vocab_size is the BPE target, the model gets len(tokenizer) (or model_vocab_size)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    # Embedding rows when a real checkpoint pads its vocab past the tokenizer's (Qwen2.5: 151,936 rows, 151,665
    # tokens); None: exactly the tokenizer's size.
    model_vocab_size: int | None = None
    tie_word_embeddings: bool = False


SIZES = {
    # ~4.5M params: a forward pass costs milliseconds on one CPU core.
    "tiny": TinySize(4096, 256, 512, 4, 4, 2, 2048),
    # ~19M params: large enough for batching and KV-transfer costs to show in benchmarks.
    "bench": TinySize(8192, 384, 1024, 8, 6, 2, 4096),
    # Qwen2.5-0.5B's layer shapes (use with --arch qwen2): ~0.5B params, 136M of them the tied embedding. The
    # corpus yields a ~52k-token BPE, so the embedding is padded to Qwen2.5's row count, as its checkpoint is.
    "0.5b": TinySize(151_936, 896, 4864, 24, 14, 2, 32768, model_vocab_size=151_936, tie_word_embeddings=True),
    # Llama-3.2-1B's layer shapes: ~1.2B params, for the GPU check (raypd/tools/gpu_check.py).
    "1b": TinySize(128_256, 2048, 8192, 16, 32, 8, 131072, model_vocab_size=128_256, tie_word_embeddings=True),
}

@dataclasses.dataclass(frozen=True)
class TinyVision:
    """Shape of the vision tower: (image_size / patch_size)^2 = 16 patches, so 16 image tokens per image."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    image_size: int = 32
    patch_size: int = 8


# Per tower: its config class, PIL image processor, and how LLaVA checkpoints built on it select features. CLIP has a
# CLS token that "default" drops (num_additional_image_tokens=1); SigLIP has none and keeps every patch.
_VISION = {
    "clip": dict(feature_layer=-2, strategy="default", extra_tokens=1),
    "siglip": dict(feature_layer=-1, strategy="full", extra_tokens=0),
}


# std 0.02 (the HF default) gives flat logits at this width (std ~0.3): greedy decoding meets
# near-ties and soon loops on a few tokens. At 0.15 the greedy top-2 gap has a median ~0.4 and is
# under 1e-3 on well below 1% of steps, and 64 greedy tokens are mostly distinct.
INITIALIZER_RANGE = 0.15

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}
# Mixture-of-experts shapes: 8 experts, 2 per token, each expert a quarter of the dense MLP (Qwen3-30B-A3B's ratio
# of 128 experts at 8 per token, scaled down); Qwen3-MoE's first layer dense, to cover mixed stacks; Qwen2-MoE's
# shared expert half the dense MLP.
_MOE_EXPERTS, _MOE_TOP_K = 8, 2

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# --- corpus ---------------------------------------------------------------------------------

_ENGLISH = (
    "the of and to in is that it for on with as was by at be this from or have an are not "
    "but had his they you which one we all were her she there been if their has when who will "
    "more no out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three model token server "
    "prefill decode cache block request batch queue worker stream sample greedy tensor layer "
    "attention kernel memory lease deadline router cluster node python quick brown fox jumps "
    "lazy dog hello world question answer story river mountain light dark green blue red"
).split()

# Common enough to become whole tokens, as accented words do in real tokenizers.
_ACCENTED = (
    "café naïve résumé façade über straße garçon jalapeño smörgåsbord déjà vu "
    "καλημέρα κόσμε λόγος θάλασσα привет мир спасибо хорошо да нет"
).split()

# Drawn from whole blocks, so each character is rare: BPE merges their shared lead bytes but
# seldom a whole character, and a CJK character or an emoji spans several tokens, as with real
# tokenizers. Detokenizers must then hold back incomplete UTF-8.
_RARE_BLOCKS = (
    (0x4E00, 0x9FFF),  # CJK unified ideographs (你好世界)
    (0x1F300, 0x1F6FF),  # pictographs, emoticons, transport (🙂🚀)
)

_PUNCT = (".", ",", "!", "?", ":", ";", " -", "")
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _pseudo_word(rng: random.Random) -> str:
    # Invented words give the BPE trainer enough distinct strings to reach an 8k vocab;
    # a fixed English list alone runs out of merges long before.
    syllables = rng.randint(1, 4)
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _rare_word(rng: random.Random) -> str:
    low, high = rng.choice(_RARE_BLOCKS)
    return "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 3)))


def _word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.005:
        return _rare_word(rng)
    if roll < 0.55:
        return rng.choice(_ENGLISH)
    if roll < 0.62:
        return rng.choice(_ACCENTED)
    if roll < 0.72:
        return str(rng.randint(0, 10_000))
    word = _pseudo_word(rng)
    return word.capitalize() if rng.random() < 0.2 else word


def corpus(num_sentences: int = 20_000, seed: int = 1234) -> list[str]:
    """Seeded random sentences: the same list on every machine, so the same tokenizer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = [_word(rng) for _ in range(rng.randint(3, 14))]
        words[0] = words[0].capitalize()
        newline = "\n" if rng.random() < 0.1 else ""
        lines.append(" ".join(words) + rng.choice(_PUNCT) + newline)
    return lines


# --- tokenizer ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    # Cached as JSON, not as an object, so every caller gets a fresh tokenizer it may mutate.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int, image_token: bool = False) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most vocab_size tokens (specials included), plus IMAGE_TOKEN if asked.

    Text is NFC-normalized, so decode(encode(s)) == unicodedata.normalize("NFC", s).
    """
    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    extra = {}
    if image_token:
        tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
        # A named special token: LlavaProcessor takes tokenizer.image_token as its placeholder.
        extra = dict(image_token=IMAGE_TOKEN)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=MULTIMODAL_CHAT_TEMPLATE if image_token else CHAT_TEMPLATE,
        # Cleanup would rewrite " ." to "." and break decode(encode(s)) == s.
        clean_up_tokenization_spaces=False,
        **extra,
    )


# --- model ----------------------------------------------------------------------------------


def _config_kwargs(arch: str, size: TinySize, overrides: dict) -> dict:
    kwargs = dataclasses.asdict(size)
    kwargs.pop("model_vocab_size")
    kwargs.update(initializer_range=INITIALIZER_RANGE)
    if arch == "mistral":
        kwargs["sliding_window"] = 4096  # explicit: the engine must not rely on HF's default
    if arch == "mixtral":
        kwargs.update(num_local_experts=_MOE_EXPERTS, num_experts_per_tok=_MOE_TOP_K)
    if arch == "qwen3_moe":
        kwargs.update(num_experts=_MOE_EXPERTS, num_experts_per_tok=_MOE_TOP_K, norm_topk_prob=True,
                      moe_intermediate_size=size.intermediate_size // 4, mlp_only_layers=[0])
    if arch == "qwen2_moe":
        kwargs.update(num_experts=_MOE_EXPERTS, num_experts_per_tok=_MOE_TOP_K,
                      moe_intermediate_size=size.intermediate_size // 4,
                      shared_expert_intermediate_size=size.intermediate_size // 2)
    if arch == "deepseek_v3":
        kwargs.update(_deepseek_v3_kwargs(size))
    if arch == "deepseek_v2":  # V2-Lite's form: q_proj without a low rank, greedy softmax routing, no groups
        kwargs.update(_deepseek_v3_kwargs(size), q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
                      n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax")
    if arch == "gemma3":
        # Gemma 3's 5 sliding-window layers to 1 global, at a tiny depth: every third layer global (below); its
        # head_dim and query_pre_attn_scalar follow the width here (256 in Gemma 3). The head is untied, unlike
        # Gemma's: with random weights, a tied head scores the input token far above the rest and greedy decoding
        # repeats it (tie_word_embeddings=True builds the tied form).
        head = size.hidden_size // size.num_attention_heads
        kwargs.update(head_dim=head, query_pre_attn_scalar=head, sliding_window=64, tie_word_embeddings=False)
    if arch == "gpt_oss":
        kwargs.update(_gpt_oss_kwargs(size))
    kwargs.update(overrides)
    if arch == "gemma3":
        kwargs.setdefault("layer_types", ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                          for i in range(kwargs["num_hidden_layers"])])
    if arch in ("qwen3", "qwen3_moe"):
        # Qwen3's default head_dim (128) ignores hidden_size / num_attention_heads.
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    return kwargs


def _deepseek_v3_kwargs(size: TinySize) -> dict:
    """DeepSeek-V3's proportions scaled down: per head 2x the no-rope dims of the rope ones and a latent of 2 heads'
    width (V3: 128 and 64, a latent of 512 + 64 over 128 heads of 192); 8 routed experts in 4 groups, the best 2
    groups of them open to each token's top 2; one shared expert; the first layer dense."""
    head = size.hidden_size // size.num_attention_heads
    return dict(num_key_value_heads=size.num_attention_heads, q_lora_rank=size.hidden_size // 2,
                kv_lora_rank=2 * head, qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head,
                n_routed_experts=_MOE_EXPERTS, num_experts_per_tok=_MOE_TOP_K, n_group=4, topk_group=2,
                n_shared_experts=1, moe_intermediate_size=size.intermediate_size // 4, first_k_dense_replace=1,
                # what DeepSeek-V3's own config.json says of its router (transformers assumes it; vLLM reads it)
                topk_method="noaux_tc", scoring_func="sigmoid")


def _gpt_oss_kwargs(size: TinySize) -> dict:
    """gpt-oss's structure scaled down: 8 experts, 2 per token, each a quarter of the dense width; sliding-window and
    full layers alternating (window 64 here, 128 in gpt-oss); its yarn rope (factor 32, beta 32 / 1) over a
    pre-yarn context of 1/32 of the size's. Weights drawn at std 0.1, not 0.15: its experts' (up + 1) grows the
    residual stream ~10x at 0.15, and fp32 rounding with it (logprobs 3e-4 from transformers' where 0.1 gives 3e-5)."""
    return dict(initializer_range=0.1, num_local_experts=_MOE_EXPERTS, num_experts_per_tok=_MOE_TOP_K,
                intermediate_size=size.intermediate_size // 4, head_dim=size.hidden_size // size.num_attention_heads,
                sliding_window=64, rope_parameters=dict(
                    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0,
                    original_max_position_embeddings=size.max_position_embeddings // 32))


def make_config(arch: str = "llama", size: str = "tiny", image_token: bool = False, **config_overrides):
    """(config, tokenizer) for arch and size; config.vocab_size == len(tokenizer) exactly, unless the size pads it.

    A vocab_size override is the BPE target; the model gets the vocab the trainer reached.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {tuple(SIZES)}")
    kwargs = _config_kwargs(arch, SIZES[size], config_overrides)
    tokenizer = build_tokenizer(kwargs["vocab_size"], image_token)
    kwargs.update(
        vocab_size=max(len(tokenizer), SIZES[size].model_vocab_size or 0),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _CONFIGS[arch][0](**kwargs), tokenizer


def build_tiny_model(
    out_dir,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size=None,
    **config_overrides,
) -> pathlib.Path:
    """Write a random-weight checkpoint + tokenizer to out_dir and return its path.

    arch "llava" takes build_tiny_llava's keywords (text_arch, vision, vision_config, llava_config) among the overrides.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(_DTYPES)}")
    if arch == "llava":
        return build_tiny_llava(out_dir, size=size, seed=seed, dtype=dtype, max_shard_size=max_shard_size,
                                **config_overrides)
    config, tokenizer = make_config(arch, size, **config_overrides)
    model = _init_model(_CONFIGS[arch][1], config, seed, dtype)
    return _save(out_dir, model, config, tokenizer, max_shard_size)


def build_tiny_llava(
    out_dir,
    text_arch: str = "llama",
    vision: str = "clip",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size=None,
    vision_config: dict | None = None,
    llava_config: dict | None = None,
    **text_overrides,
) -> pathlib.Path:
    """A random-weight LlavaForConditionalGeneration checkpoint + tokenizer + processor in out_dir.

    vision_config overrides the tower's config (TinyVision's fields, hidden_act, ...); llava_config the top level
    (vision_feature_layer, vision_feature_select_strategy, projector_hidden_act, multimodal_projector_bias); the rest
    the text model's.
    """
    if vision not in VISION_TOWERS:
        raise ValueError(f"unknown vision tower {vision!r}; expected one of {VISION_TOWERS}")
    text, tokenizer = make_config(text_arch, size, image_token=True, **text_overrides)
    tower = _vision_config(vision, vision_config or {})
    top = _llava_config(vision, text, tower, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), llava_config or {})
    model = _init_model(transformers.LlavaForConditionalGeneration, top, seed, dtype)
    out = _save(out_dir, model, text, tokenizer, max_shard_size)
    _processor(vision, tower, top, tokenizer).save_pretrained(out)
    return out


def _vision_config(vision: str, overrides: dict):
    kwargs = dataclasses.asdict(TinyVision())
    if vision == "siglip":
        kwargs["vision_use_head"] = False  # LLaVA never reads the pooling head: a SigLIP tower for it ships none
    kwargs.update(overrides)
    config_class = transformers.CLIPVisionConfig if vision == "clip" else transformers.SiglipVisionConfig
    return config_class(**kwargs)


def _llava_config(vision: str, text, tower, image_token_id: int, overrides: dict):
    kwargs = dict(
        vision_feature_layer=_VISION[vision]["feature_layer"],
        vision_feature_select_strategy=_VISION[vision]["strategy"],
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
    )
    kwargs.update(overrides)
    patches = (tower.image_size // tower.patch_size) ** 2
    drop_cls = kwargs["vision_feature_select_strategy"] == "default"
    return transformers.LlavaConfig(
        vision_config=tower,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=patches + _VISION[vision]["extra_tokens"] - drop_cls,
        tie_word_embeddings=text.tie_word_embeddings,
        **kwargs,
    )


def _processor(vision: str, tower, top, tokenizer):
    """LlavaProcessor with the PIL image processor of the tower's family, sized to the tower's input."""
    side = tower.image_size
    if vision == "clip":
        images = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    else:
        images = transformers.SiglipImageProcessorPil(size={"height": side, "width": side})
    return transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=tower.patch_size,
        vision_feature_select_strategy=top.vision_feature_select_strategy,
        num_additional_image_tokens=_VISION[vision]["extra_tokens"],
        chat_template=MULTIMODAL_CHAT_TEMPLATE,
    )


def _init_model(model_class, config, seed: int, dtype: str):
    # Init in fp32 then cast, so a bf16 build holds the rounded fp32 weights of the same seed.
    # fork_rng: building a model must not reseed the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config).to(_DTYPES[dtype])


def _save(out_dir, model, text_config, tokenizer, max_shard_size) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    tokenizer.model_max_length = text_config.max_position_embeddings
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    # Only the special ids: sampling defaults here would silently change what "greedy" means.
    transformers.GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def num_parameters(model_dir) -> int:
    """Parameter count read from the safetensors headers (no weights loaded)."""
    total = 0
    for path in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m raypd.tools.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=(*ARCHITECTURES, "llava"))
    parser.add_argument("--size", default="tiny", choices=tuple(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=tuple(_DTYPES))
    parser.add_argument("--text-arch", default="llama", choices=LLAVA_TEXT_ARCHITECTURES,
                        help="the text model of a llava")
    parser.add_argument("--vision", default="clip", choices=VISION_TOWERS, help="vision tower of --arch llava")
    args = parser.parse_args(argv)
    llava = dict(text_arch=args.text_arch, vision=args.vision) if args.arch == "llava" else {}
    out = build_tiny_model(args.out_dir, args.arch, args.size, args.seed, args.dtype, **llava)
    print(f"{out} {num_parameters(out):,} parameters")


if __name__ == "__main__":
    main()
