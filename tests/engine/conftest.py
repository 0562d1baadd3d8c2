"""Fixtures for the multimodal tests: tiny LLaVA checkpoints, perturbed."""

from __future__ import annotations

import json
import re
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.tiny import build_tiny_llava

# LayerNorm / RMSNorm weights: every norm the towers and text models have (pre_layrnorm is transformers' spelling).
_NORM_WEIGHT = re.compile(r"(norm\d?|layrnorm|layernorm)\.weight$")


def perturb(model_dir, seed: int = 0) -> None:
    """Random biases and norm weights: the builder leaves them at 0 and 1, which would hide a bias or norm bug."""
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)  # by name: shard-independent
            if name.endswith(".bias"):
                tensors[name] = (0.1 * torch.randn(t.shape, generator=gen)).to(t.dtype)
            elif _NORM_WEIGHT.search(name):
                tensors[name] = (1 + 0.2 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def llava_factory(tmp_path_factory):
    """llava_factory(text_arch="llama", vision="clip", **build_args) -> path of a perturbed tiny LLaVA, built once."""
    built: dict[str, str] = {}

    def make(text_arch: str = "llama", vision: str = "clip", **kwargs):
        key = json.dumps([text_arch, vision, kwargs], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"llava-{vision}-{text_arch}")
            perturb(build_tiny_llava(out, text_arch=text_arch, vision=vision, **kwargs))
            built[key] = out
        return built[key]

    return make
