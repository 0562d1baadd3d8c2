"""Shared fixtures: tiny checkpoints built once per test session with the project's own builder."""

from __future__ import annotations

import os

# OpenMP's default spin-wait makes torch threads burn the cores they wait on; on a small shared host that slows
# everything else (Ray workers, the other engine) by an order of magnitude. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.tiny import build_tiny_model  # noqa: E402


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
