"""What the engine needs to know about a checkpoint, read once from its directory into a frozen ModelSpec.

transformers' AutoConfig reads config.json so that class defaults (Mistral's sliding_window, Qwen's layer_types) and
legacy rope keys are folded in exactly as transformers itself would see them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import pathlib
import struct
from dataclasses import dataclass, field

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM",
                           "GptOssForCausalLM"}
# Image + text checkpoints whose text part is one of the above (the vision part is engine/multimodal/vision.py's).
MULTIMODAL_ARCHITECTURES = {"LlavaForConditionalGeneration"}
# A LLaVA text_config names its family only by model_type.
_TEXT_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# Where a LLaVA checkpoint keeps its text model's tensors: language_model.model.* and language_model.lm_head.weight,
# the names transformers (4.x and 5.x alike) writes on disk.
LLAVA_TEXT_PREFIX = "language_model."

# Keys that record who wrote the file, not what the model computes: kept out of the fingerprint.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
# Bytes read from the start of each tensor: cheap, yet two random inits of the same shapes differ.
_FINGERPRINT_SAMPLE_BYTES = 64


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts family: a router picks top_k of num_experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)
    weights_in_model_dtype: bool  # Qwen3-MoE casts the routing weights to the model dtype; Mixtral keeps float32
    sparse_layers: tuple[bool, ...]  # per layer: the sparse block, or the dense MLP (intermediate_size)
    # A shared expert every token goes through (None: none): Qwen2-MoE scales it by sigmoid(shared_expert_gate(x)),
    # DeepSeek adds it as is (its n_shared_experts experts as one of their summed width).
    shared_intermediate_size: int | None = None
    shared_gated: bool = True
    # DeepSeek-V3's router: sigmoid scores; the experts chosen by score + a per-expert correction bias, only from
    # the topk_groups groups (of num_groups) whose two best experts score highest; the chosen scores (renormalized
    # or not) times routed_scaling_factor are the weights. "softmax": the top_k softmax probabilities (DeepSeek-V2's
    # only from the topk_groups groups with the highest best expert, times routed_scaling_factor).
    # gpt-oss's: the top_k router logits (the router has a bias), then their softmax ("topk_softmax").
    scoring: str = "softmax"  # "softmax" | "sigmoid" | "topk_softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss's experts: biases, gate and up interleaved, gate clamped above and up both ways at swiglu_limit,
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate). None: SiLU-gated experts without biases.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    router_float32: bool = False  # DeepSeek's router weight stays float32 whatever the model's dtype

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} of them "
                             "chosen: the groups must divide the experts and be at least the chosen")


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): each token caches one latent, its compressed key/value
    (kv_lora_rank, normed) and its rotated positional key (qk_rope_head_dim), shared by every head; each head's
    keys and values are kv_b_proj of the latent (engine/model/mla.py)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite); else q_a_proj, norm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims rotate in (even, odd) pairs, not in halves
    scale: float  # softmax scale: qk_head_dim ** -0.5, times yarn's mscale squared where the rope sets mscale_all_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GemmaSpec:
    """What Gemma 3's text model does differently (engine/model/gemma.py): norms scale by (1 + weight) in float32, a
    norm after attention and around the MLP, embeddings times sqrt(hidden_size), gelu-tanh MLPs, the softmax scale
    from query_pre_attn_scalar, and sliding-window layers with a rope of their own."""

    query_pre_attn_scalar: float
    final_logit_softcapping: float | None  # logits = cap * tanh(logits / cap) where set
    local_rope_inv_freq: tuple[float, ...] = field(repr=False)  # the sliding-window layers' rope (head_dim // 2,)
    local_rope_attention_scaling: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    checkpoint_dtype: str  # "float32" | "bfloat16" | "float16"
    fingerprint: str
    rope_type: str
    rope_inv_freq: tuple[float, ...] = field(repr=False)  # (head_dim // 2,) fp32 values, exact as floats
    rope_attention_scaling: float = 1.0  # cos/sin multiplier (1 unless yarn or longrope)
    # Prepended to every tensor name of the text model: "" for a text checkpoint, "language_model." for LLaVA's.
    weight_prefix: str = ""
    moe: MoeSpec | None = None  # a mixture-of-experts model's sparse MLP; None: every layer's MLP is dense
    mla: MlaSpec | None = None  # latent attention (head_dim is then the rope part's); None: q/k/v heads
    gemma: GemmaSpec | None = None  # Gemma 3's layer structure; rope_inv_freq is then its global layers'
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(f"{len(self.moe.sparse_layers)} MoE layer flags for {self.num_layers} layers")
        if len(self.rope_inv_freq) * 2 != self.head_dim:
            raise ValueError(f"rope covers {2 * len(self.rope_inv_freq)} dims, head_dim is {self.head_dim}")


def load_spec(model_dir) -> ModelSpec:
    """Reads config.json (+ generation_config.json, safetensors headers) of a local HF checkpoint."""
    model_dir = pathlib.Path(model_dir)
    # Checked on the raw file first, so a model_type transformers does not know still gets our message.
    raw = json.loads((model_dir / "config.json").read_text())
    arch, prefix = _architecture(raw), ""
    config = top = transformers.AutoConfig.from_pretrained(model_dir)
    if arch in MULTIMODAL_ARCHITECTURES:  # the spec is the text part's; the fingerprint still covers the whole model
        arch, prefix, config = _text_architecture(arch, raw), LLAVA_TEXT_PREFIX, top.text_config
    if arch not in _GEMMA_ARCHITECTURES and getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gemma = _gemma(config, head_dim) if arch in _GEMMA_ARCHITECTURES else None
    rope_type, inv_freq, scaling = _rope(config, head_dim, "full_attention" if gemma else None)
    headers = read_safetensors_headers(model_dir)
    return ModelSpec(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=1 if arch in _MLA_ARCHITECTURES else getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),  # LLaVA: the top level decides
        **_biases(arch, config),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        sliding_windows=_sliding_windows(arch, config),
        max_position_embeddings=config.max_position_embeddings,
        **_special_ids(model_dir, config),
        checkpoint_dtype=_checkpoint_dtype(top, headers),
        fingerprint=_fingerprint(model_dir, headers),
        rope_type=rope_type,
        rope_inv_freq=tuple(float(f) for f in inv_freq.tolist()),
        rope_attention_scaling=float(scaling),
        weight_prefix=prefix,
        moe=_moe(arch, config),
        mla=_mla(config) if arch in _MLA_ARCHITECTURES else None,
        gemma=gemma,
        attention_sinks=arch == "GptOssForCausalLM",
    )


def _architecture(raw_config: dict) -> str:
    archs = raw_config.get("architectures") or []
    arch = archs[0] if archs else f"<none given; model_type {raw_config.get('model_type')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES | MULTIMODAL_ARCHITECTURES:
        supported = sorted(SUPPORTED_ARCHITECTURES) + sorted(MULTIMODAL_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(supported)}")
    return arch


def _text_architecture(arch: str, raw_config: dict) -> str:
    model_type = (raw_config.get("text_config") or {}).get("model_type", "llama")  # LlavaConfig's default text model
    text_arch = _TEXT_ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
    if text_arch is None:
        supported = ", ".join(_TEXT_ARCHITECTURE_OF_MODEL_TYPE)
        raise ValueError(f"{arch}: unsupported text model_type {model_type!r}; supported: {supported}")
    return text_arch


def _biases(arch: str, config) -> dict:
    # Each family's modeling file hard-codes its own rule (PARITY.md "Biases").
    if arch == "Qwen2ForCausalLM":
        return dict(attention_bias=True, o_bias=False, mlp_bias=False)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return dict(attention_bias=False, o_bias=False, mlp_bias=False)
    if arch == "Qwen2MoeForCausalLM":
        return dict(attention_bias=bool(config.qkv_bias), o_bias=False, mlp_bias=False)
    attn = bool(getattr(config, "attention_bias", False))
    mlp = bool(getattr(config, "mlp_bias", False)) if arch == "LlamaForCausalLM" else False
    return dict(attention_bias=attn, o_bias=attn, mlp_bias=mlp)


_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM",)


def _gemma(config, head_dim: int) -> GemmaSpec:
    """As Gemma3ForCausalLM reads its text config; what SDPA cannot compute is refused by name."""
    problems = []
    if config.hidden_activation != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {config.hidden_activation!r} (only 'gelu_pytorch_tanh')")
    if config.attn_logit_softcapping is not None:
        problems.append(f"attn_logit_softcapping {config.attn_logit_softcapping} (only null, as Gemma 3 sets it)")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention (only causal)")
    if problems:
        raise ValueError(f"Gemma3ForCausalLM: not supported: {'; '.join(problems)}")
    _, inv_freq, scaling = _rope(config, head_dim, "sliding_attention")
    return GemmaSpec(float(config.query_pre_attn_scalar), config.final_logit_softcapping,
                     tuple(float(f) for f in inv_freq.tolist()), float(scaling))


def _mla(config) -> MlaSpec:
    """As DeepseekV2/V3Attention read their config; head_dim is the rope part's (what _rope rotates). V2 rotates
    (even, odd) pairs as complex numbers: the same rotation as V3's rope_interleave (its output keeps the pairs
    where V3's splits them into halves, the same for q . k)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return MlaSpec(config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim, bool(getattr(config, "rope_interleave", True)), scale)


def _moe(arch: str, config) -> MoeSpec | None:
    """The sparse MLP, read as each family's modeling file reads its config."""
    n = config.num_hidden_layers
    if arch == "MixtralForCausalLM":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=True, weights_in_model_dtype=False, sparse_layers=(True,) * n)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        dense = set(config.mlp_only_layers or ())
        sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
                       for i in range(n))
        shared = config.shared_expert_intermediate_size if arch == "Qwen2MoeForCausalLM" else None
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       renormalize=bool(config.norm_topk_prob), weights_in_model_dtype=True, sparse_layers=sparse,
                       shared_intermediate_size=shared)
    if arch in _MLA_ARCHITECTURES:  # DeepSeek: dense first layers, then routed experts and ungated shared ones
        v3 = arch == "DeepseekV3ForCausalLM"
        grouped = v3 or config.topk_method == "group_limited_greedy"
        width = config.moe_intermediate_size
        return MoeSpec(config.n_routed_experts, config.num_experts_per_tok, width,
                       renormalize=v3 and bool(config.norm_topk_prob),  # V2's router never renormalizes
                       weights_in_model_dtype=False,
                       sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(n)),
                       shared_intermediate_size=width * config.n_shared_experts or None, shared_gated=False,
                       scoring="sigmoid" if v3 else "softmax", num_groups=config.n_group if grouped else 1,
                       topk_groups=config.topk_group if grouped else 1,
                       routed_scaling_factor=float(config.routed_scaling_factor), router_float32=True)
    if arch == "GptOssForCausalLM":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=False, weights_in_model_dtype=True, sparse_layers=(True,) * n,
                       scoring="topk_softmax", swiglu_limit=float(config.swiglu_limit),
                       swiglu_alpha=float(config.swiglu_alpha))
    return None


def _sliding_windows(arch: str, config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        # these apply it on every layer whenever it is set (Qwen3-MoE's config sets it only with use_sliding_window)
        return (window,) * n
    layer_types = getattr(config, "layer_types", None)
    if window is None or not layer_types:
        return (None,) * n
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _rope(config, head_dim: int, layer_type: str | None = None) -> tuple[str, torch.Tensor, float]:
    """(rope type, inv_freq (head_dim // 2,) fp32, cos/sin scaling). dynamic and longrope match transformers only
    within the original context length, where transformers does not rescale either. layer_type: the rope of one kind
    of layer, where the config keeps one per kind (Gemma 3's full and sliding-window layers)."""
    params = config.rope_parameters or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        # Exactly transformers' expression, in fp32: an fp64 computation cast down differs in the last bits.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (head_dim // 2,)
        return rope_type, inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kind = {} if layer_type is None else dict(layer_type=layer_type)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kind)
    return rope_type, inv_freq.float(), scaling


def _special_ids(model_dir: pathlib.Path, config) -> dict:
    gen = {}
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
    eos: list[int] = []
    for source in (getattr(config, "eos_token_id", None), gen.get("eos_token_id")):
        for token in [source] if isinstance(source, int) else (source or []):
            if token not in eos:
                eos.append(token)
    bos = getattr(config, "bos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    return dict(
        eos_token_ids=tuple(eos),
        bos_token_id=bos if bos is not None else gen.get("bos_token_id"),
        pad_token_id=pad if pad is not None else gen.get("pad_token_id"),
    )


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _checkpoint_dtype(config, headers: dict[str, dict]) -> str:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype in _SAFETENSORS_DTYPES.values():
        return dtype
    # No dtype recorded: the weights' own dtype is what from_pretrained would pick.
    for info in headers.values():
        if info["dtype"] in _SAFETENSORS_DTYPES:
            return _SAFETENSORS_DTYPES[info["dtype"]]
    return "float32"


def run_dtype(requested: str | None, checkpoint_dtype: str, device) -> str:
    """The dtype a model is loaded in: requested, where None is the checkpoint's own (as transformers loads it) and
    "auto" is auto_dtype's choice for this device."""
    if requested == "auto":
        return auto_dtype(checkpoint_dtype, device)
    return requested or checkpoint_dtype


def auto_dtype(checkpoint_dtype: str, device, cpu_flags: frozenset[str] | None = None) -> str:
    """What a deployment's `dtype: auto` runs: the checkpoint's dtype, except that a float32 checkpoint runs bfloat16
    where the device computes bf16 natively: a CUDA GPU with bf16, or a CPU with AMX-BF16 or AVX512-BF16 (there bf16
    matmuls run 2-5x faster than fp32). vLLM and TensorRT-LLM serve float32 checkpoints in 16 bits the same way.
    `dtype: float32` keeps exact parity with transformers. cpu_flags: this CPU's (/proc/cpuinfo) unless given."""
    if checkpoint_dtype != "float32":
        return checkpoint_dtype
    kind = torch.device(device).type
    if kind == "cuda":
        native = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    elif kind == "cpu":
        native = bool((cpu_flags if cpu_flags is not None else this_cpu_flags()) & {"amx_bf16", "avx512_bf16"})
    else:
        native = False
    return "bfloat16" if native else "float32"


def this_cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def safetensors_files(model_dir) -> list[pathlib.Path]:
    """The checkpoint's weight files: the shards the index names, else model.safetensors."""
    model_dir = pathlib.Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    return [single]


def read_safetensors_headers(model_dir) -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets, file, data_start} for every tensor, from the headers alone."""
    tensors: dict[str, dict] = {}
    for path in safetensors_files(model_dir):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            tensors[name] = dict(info, file=path, data_start=8 + size)
    return tensors


def _fingerprint(model_dir: pathlib.Path, headers: dict[str, dict]) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(open(path, "rb")) for path in {i["file"] for i in headers.values()}}
        # Per tensor name, not per file, so the same weights sharded differently fingerprint the same.
        for name in sorted(headers):
            info = headers[name]
            h.update(f"|{name}:{info['dtype']}:{info['shape']}:".encode())
            h.update(_sample(files[info["file"]], info))
    return h.hexdigest()


def _sample(f, info: dict) -> bytes:
    begin, end = info["data_offsets"]
    f.seek(info["data_start"] + begin)
    return f.read(min(_FINGERPRINT_SAMPLE_BYTES, end - begin))
