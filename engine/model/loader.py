"""Copies a Hugging Face safetensors checkpoint (one file or shards) into CausalLM's parameters.

Our parameter names are transformers' without the "model." prefix, except the fused projections, each filled from
several checkpoint tensors stacked along the output dimension, and a sparse MLP's, under the family's block name. A
multimodal checkpoint's text model lives under spec.weight_prefix; its other tensors (vision tower, projector) are
engine/multimodal/vision.py's and ignored here. A tensor-parallel rank reads only its slices (engine/parallel/shard.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from safetensors import safe_open

from engine.config import ModelSpec, read_safetensors_headers
from engine.parallel.shard import Shard

# fused parameter -> the checkpoint's projections, in the order they are stacked
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# A sparse MLP, per family: the checkpoint's block name (the router and experts under it) and each expert's
# projections behind our fused ones, in stacking order (on disk both keep one tensor per expert and projection).
_EXPERTS = {
    "Qwen2MoeForCausalLM": ("mlp", {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}),
    "Qwen3MoeForCausalLM": ("mlp", {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}),
    "MixtralForCausalLM": ("block_sparse_moe", {"w13": ("w1", "w3"), "w2": ("w2",)}),
    "DeepseekV2ForCausalLM": ("mlp", {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}),
    "DeepseekV3ForCausalLM": ("mlp", {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}),
    "GptOssForCausalLM": ("mlp", {}),  # its experts are stacked tensors, named as ours (ClampedSwigluExperts)
}
# Where the checkpoint keeps the router (ours: gate), where it is not "gate".
_ROUTER = {"GptOssForCausalLM": "router"}
# Where the checkpoint keeps the shared expert (ours: shared_expert), where it is not Qwen2-MoE's name.
_SHARED_EXPERT = {"DeepseekV2ForCausalLM": "shared_experts", "DeepseekV3ForCausalLM": "shared_experts"}
# Checkpoint tensors that carry no weights of ours (old exports saved RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_weights(model: torch.nn.Module, model_dir) -> None:
    """Fills every parameter of model from model_dir; raises ValueError naming any missing, unexpected or
    mis-shaped tensor. Tied lm_head shares the embedding parameter, so it is filled through it. A tensor-parallel
    rank's model (model.shard) reads only its part of each split tensor."""
    headers = read_safetensors_headers(model_dir)
    targets = _targets(model)  # checkpoint name -> (parameter, row offset, source)
    missing = sorted(set(targets) - set(headers))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing)}")
    ours = [n for n in headers if n.startswith(model.spec.weight_prefix)]
    unexpected = sorted(n for n in ours if n not in targets and not _ignorable(n, model.spec))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensor(s) in checkpoint: {', '.join(unexpected)}")
    for name, info in headers.items():
        if name in targets and tuple(info["shape"]) != targets[name][2].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(info['shape'])}, model expects {targets[name][2].shape}")
    by_file = defaultdict(list)
    for name in targets:
        by_file[headers[name]["file"]].append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    param, row, source = targets[name]
                    param[row : row + source.num_rows].copy_(source.read(f))  # copy_ casts to the model dtype


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor, its whole shape, and the part of it a rank holds (rows, and columns of a 2-d one)."""

    name: str
    shape: tuple[int, ...]
    rows: slice | None = None  # None: all. Of a 3-d tensor (stacked experts): its second and third dimensions
    cols: slice | None = None

    @property
    def num_rows(self) -> int:
        if len(self.shape) == 3:  # every expert
            return self.shape[0]
        return len(range(*(self.rows or slice(None)).indices(self.shape[0])))

    def read(self, f) -> torch.Tensor:
        rows, cols = self.rows or slice(None), self.cols or slice(None)
        part = f.get_slice(self.name)  # reads only the part asked for
        if len(self.shape) == 3:
            return part[:, rows, cols]
        return part[rows] if len(self.shape) == 1 else part[rows, cols]


def _targets(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int, _Source]]:
    targets = {}
    # named_parameters lists a tied parameter once, under embed_tokens: lm_head.weight is then not expected.
    for ours, param in model.named_parameters():
        row = 0
        for source in _sources(ours, tuple(param.shape), model.spec, model.shard):
            targets[source.name] = (param, row, source)
            row += source.num_rows
    return targets


def _sources(ours: str, shape: tuple[int, ...], spec: ModelSpec, shard: Shard) -> list[_Source]:
    """Our parameter name (and its shape on this rank) -> the checkpoint tensors that fill it, in stacking order.
    Column-parallel projections take rows of each tensor, row-parallel ones columns (engine/parallel/shard.py)."""
    prefix = spec.weight_prefix
    if ours.startswith("lm_head.") or ours == "embed_tokens.weight":  # vocab-parallel: this rank's rows
        name = prefix + ours if ours.startswith("lm_head.") else f"{prefix}model.{ours}"
        return [_Source(name, (spec.vocab_size, shape[1]), rows=shard.split(spec.vocab_size))]
    if spec.moe is not None and any(f".mlp.{part}." in ours for part in ("gate", "experts", "shared_expert")):
        names, width = _moe_names(ours, spec)
        if spec.moe.swiglu_limit is not None and ".experts." in ours:  # gpt-oss's stacked experts
            return [_stacked_experts(names[0], shape, spec, shard)]
        if width is None:  # the router
            return [_Source(names[0], shape)]
        if ".w2." in ours:
            return [_Source(names[0], (shape[0], width), cols=shard.split(width))]
        return [_Source(n, (width, *shape[1:]), rows=shard.split(width)) for n in names]
    if ours.endswith("self_attn.sinks"):  # one per query head
        return [_Source(f"{prefix}model.{ours}", (spec.num_heads,), rows=shard.heads(spec))]
    if spec.mla is not None and ".self_attn." in ours:
        return [_mla_source(f"{prefix}model.{ours}", shape, spec, shard)]
    for fused, parts in _FUSED.items():
        head, sep, tail = ours.partition(fused)
        if sep:
            names = [f"{prefix}model.{head}{part}{tail}" for part in parts]
            widths, takes = _split_rows(fused, spec), _taken_rows(fused, spec, shard)
            return [_Source(n, (w, *shape[1:]), rows=t) for n, w, t in zip(names, widths, takes)]
    name = f"{prefix}model.{ours}"
    if ours.endswith("self_attn.o_proj.weight"):
        return [_Source(name, (shape[0], spec.num_heads * spec.head_dim), cols=_head_rows(shard.heads(spec), spec))]
    if ours.endswith("mlp.down_proj.weight"):
        width = spec.intermediate_size
        return [_Source(name, (shape[0], width), cols=shard.split(width))]
    return [_Source(name, shape)]


def _stacked_experts(name: str, shape: tuple[int, ...], spec: ModelSpec, shard: Shard) -> _Source:
    """gpt-oss's experts, each rank's width slice: gate_up_proj's interleaved (gate, up) column pairs of it and
    their biases, down_proj's rows of it; down_proj's bias whole (rank 0 adds it)."""
    width, experts = spec.moe.intermediate_size, spec.moe.num_experts
    mine = shard.split(width)
    pairs = slice(2 * mine.start, 2 * mine.stop)
    if name.endswith("gate_up_proj"):
        return _Source(name, (experts, spec.hidden_size, 2 * width), cols=pairs)
    if name.endswith("gate_up_proj_bias"):
        return _Source(name, (experts, 2 * width), cols=pairs)
    if name.endswith("down_proj"):
        return _Source(name, (experts, width, spec.hidden_size), rows=mine)
    return _Source(name, shape)


def _mla_source(name: str, shape: tuple[int, ...], spec: ModelSpec, shard: Shard) -> _Source:
    """Latent attention: the per-head projections split by heads (q_b_proj or q_proj and kv_b_proj by rows, o_proj by
    columns); the latent projections and norms whole on every rank."""
    mla, heads = spec.mla, shard.heads(spec)
    qk_dim, kv_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    per_head = {"q_proj": qk_dim, "q_b_proj": qk_dim, "kv_b_proj": kv_dim}
    proj = name.rsplit(".", 2)[-2]  # "q_b_proj" of "model.layers.0.self_attn.q_b_proj.weight"
    if proj in per_head:
        width = per_head[proj]
        return _Source(name, (spec.num_heads * width, shape[1]), rows=slice(heads.start * width, heads.stop * width))
    if proj == "o_proj" and name.endswith(".weight"):
        width = mla.v_head_dim
        return _Source(name, (shape[0], spec.num_heads * width), cols=slice(heads.start * width, heads.stop * width))
    return _Source(name, shape)


def _taken_rows(fused: str, spec: ModelSpec, shard: Shard) -> list[slice]:
    """The rows of each stacked tensor this rank holds: its heads of q, k and v, or its share of gate and up."""
    if fused == "mlp.gate_up_proj":
        return [shard.split(spec.intermediate_size)] * 2
    kv = _head_rows(shard.kv_heads(spec), spec)
    return [_head_rows(shard.heads(spec), spec), kv, kv]


def _head_rows(heads: slice, spec: ModelSpec) -> slice:
    return slice(heads.start * spec.head_dim, heads.stop * spec.head_dim)


def _moe_names(ours: str, spec: ModelSpec) -> tuple[list[str], int | None]:
    """The router ("layers.{i}.mlp.gate.weight") or one expert's fused projection
    ("layers.{i}.mlp.experts.{e}.w13.weight", "layers.{i}.mlp.shared_expert.w2.weight") -> (checkpoint tensors under
    the family's block name, the expert's intermediate width; None for the router)."""
    block, parts = _EXPERTS[spec.architecture]
    name = f"{spec.weight_prefix}model.{ours.replace('.mlp.', f'.{block}.', 1)}"
    name = name.replace(".shared_expert.", f".{_SHARED_EXPERT.get(spec.architecture, 'shared_expert')}.")
    name = name.replace(".mlp.gate.", f".mlp.{_ROUTER.get(spec.architecture, 'gate')}.")
    head, leaf, tail = name.rpartition(".w13." if ".w13." in name else ".w2.")
    if not leaf:  # the router
        return [name], None
    width = spec.moe.shared_intermediate_size if ".shared_expert." in ours else spec.moe.intermediate_size
    return [f"{head}.{part}.{tail}" for part in parts[leaf.strip(".")]], width


def _split_rows(fused: str, spec: ModelSpec) -> tuple[int, ...]:
    if fused == "mlp.gate_up_proj":
        return (spec.intermediate_size, spec.intermediate_size)
    kv = spec.num_kv_heads * spec.head_dim
    return (spec.num_heads * spec.head_dim, kv, kv)


def _ignorable(name: str, spec: ModelSpec) -> bool:
    # A tied checkpoint may still ship lm_head.weight; transformers ignores it in favour of the embeddings.
    tied_head = spec.tie_word_embeddings and name == spec.weight_prefix + "lm_head.weight"
    return name.endswith(_IGNORED_SUFFIXES) or tied_head
