"""Shared fixtures: tiny checkpoints (text, and LLaVA perturbed) built once per test session with the project's own
builder."""

from __future__ import annotations

import os

# OpenMP's default spin-wait makes torch threads burn the cores they wait on; on a small shared host that slows
# everything else (Ray workers, the other engine) by an order of magnitude. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every Ray this session starts (a module's own local one, the two-node cluster of tests/cluster) runs without token
# auth: a driver that started a Ray with it and then joins one without it has every actor it creates cancelled
# ("all references to the actor were removed"), which failed tests/cluster/owner after tests/postproc in one session.
os.environ["RAY_AUTH_MODE"] = "disabled"

import json  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from raypd.tools.tiny import build_tiny_llava, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch="llama", **overrides) -> path of a tiny checkpoint, built once per argument set."""
    built: dict[str, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = str(build_tiny_model(out, arch=arch, **overrides))
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tests share two cores with Ray workers and each other; one intra-op thread keeps timings stable.
    torch.set_num_threads(1)


# LayerNorm / RMSNorm weights: every norm the towers and text models have (pre_layrnorm is transformers' spelling).
_NORM_WEIGHT = re.compile(r"(norm\d?|layrnorm|layernorm)\.weight$")


def perturb(model_dir, seed: int = 0) -> None:
    """Random biases and norm weights: the builder leaves them at 0 and 1, which would hide a bias or norm bug."""
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)  # by name: shard-independent
            if name.endswith((".bias", "_bias")):  # "_bias": DeepSeek-V3's router's, gpt-oss's experts'
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
