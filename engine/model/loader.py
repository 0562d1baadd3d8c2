"""Copies a Hugging Face safetensors checkpoint (one file or shards) into CausalLM's parameters.

Our parameter names are transformers' without the "model." prefix, except the fused projections, each filled from
several checkpoint tensors stacked along the output dimension, and a sparse MLP's, under the family's block name. A
multimodal checkpoint's text model lives under spec.weight_prefix; its other tensors (vision tower, projector) are engine/multimodal/vision.py's and ignored here.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from safetensors import safe_open

from engine.config import ModelSpec, read_safetensors_headers

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
}
# Checkpoint tensors that carry no weights of ours (old exports saved RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_weights(model: torch.nn.Module, model_dir) -> None:
    """Fills every parameter of model from model_dir; raises ValueError naming any missing, unexpected or
    mis-shaped tensor. Tied lm_head shares the embedding parameter, so it is filled through it."""
    headers = read_safetensors_headers(model_dir)
    targets = _targets(model)  # checkpoint name -> (parameter, row offset, expected shape)
    missing = sorted(set(targets) - set(headers))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing)}")
    ours = [n for n in headers if n.startswith(model.spec.weight_prefix)]
    unexpected = sorted(n for n in ours if n not in targets and not _ignorable(n, model.spec))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensor(s) in checkpoint: {', '.join(unexpected)}")
    for name, info in headers.items():
        if name in targets and tuple(info["shape"]) != targets[name][2]:
            raise ValueError(f"{name}: checkpoint shape {tuple(info['shape'])}, model expects {targets[name][2]}")
    by_file = defaultdict(list)
    for name in targets:
        by_file[headers[name]["file"]].append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    param, row, shape = targets[name]
                    param[row : row + shape[0]].copy_(f.get_tensor(name))  # copy_ casts to the model dtype


def _targets(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
    targets = {}
    # named_parameters lists a tied parameter once, under embed_tokens: lm_head.weight is then not expected.
    for ours, param in model.named_parameters():
        row = 0
        for hf_name, rows in _sources(ours, model.spec):
            rows = param.shape[0] if rows is None else rows
            targets[hf_name] = (param, row, (rows, *param.shape[1:]))
            row += rows
    return targets


def _sources(ours: str, spec: ModelSpec) -> list[tuple[str, int | None]]:
    """Our parameter name -> [(checkpoint name, rows it fills; None = all)], in stacking order."""
    prefix = spec.weight_prefix
    if ours.startswith("lm_head."):
        return [(prefix + ours, None)]
    if spec.moe is not None and any(f".mlp.{part}." in ours for part in ("gate", "experts", "shared_expert")):
        return _moe_sources(ours, spec)
    for fused, parts in _FUSED.items():
        head, sep, tail = ours.partition(fused)
        if sep:
            return [(f"{prefix}model.{head}{part}{tail}", rows) for part, rows in zip(parts, _split_rows(fused, spec))]
    return [(f"{prefix}model.{ours}", None)]


def _moe_sources(ours: str, spec: ModelSpec) -> list[tuple[str, int | None]]:
    """The router ("layers.{i}.mlp.gate.weight") or one expert's fused projection
    ("layers.{i}.mlp.experts.{e}.w13.weight", "layers.{i}.mlp.shared_expert.w2.weight") -> checkpoint tensors under the
    family's block name."""
    block, parts = _EXPERTS[spec.architecture]
    name = f"{spec.weight_prefix}model.{ours.replace('.mlp.', f'.{block}.', 1)}"
    head, leaf, tail = name.rpartition(".w13." if ".w13." in name else ".w2.")
    if not leaf:  # the router
        return [(name, None)]
    width = spec.moe.shared_intermediate_size if ".shared_expert." in name else spec.moe.intermediate_size
    rows = width if leaf == ".w13." else None
    return [(f"{head}.{part}.{tail}", rows) for part in parts[leaf.strip(".")]]


def _split_rows(fused: str, spec: ModelSpec) -> tuple[int, ...]:
    if fused == "mlp.gate_up_proj":
        return (spec.intermediate_size, spec.intermediate_size)
    kv = spec.num_kv_heads * spec.head_dim
    return (spec.num_heads * spec.head_dim, kv, kv)


def _ignorable(name: str, spec: ModelSpec) -> bool:
    # A tied checkpoint may still ship lm_head.weight; transformers ignores it in favour of the embeddings.
    tied_head = spec.tie_word_embeddings and name == spec.weight_prefix + "lm_head.weight"
    return name.endswith(_IGNORED_SUFFIXES) or tied_head
