"""The demo's `ray up` file and serve config: the ones users get (configs/cluster/local.yaml, configs/multinode.yaml),
with only what this machine forces changed. Everything not named here is used as it is in those files."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

from nodes import NODES

REPO = pathlib.Path(__file__).resolve().parents[2]
HEAD, PREFILL, DECODE = NODES
CLUSTER_NAME = "raypd-demo"
SERVE_CONFIG = "configs/cluster-demo.yaml"  # where the serve config goes on the head, relative to ~/raypd


def cluster_file(ssh_key: pathlib.Path, venv: pathlib.Path) -> dict[str, Any]:
    """configs/cluster/local.yaml for the demo's nodes: its head and first prefill and decode address, root over the
    demo's key, and setup_commands that reuse this machine's venv (every node shares this machine's disk) instead of
    installing torch and Ray three times, and build the tiny model instead of downloading one."""
    config = yaml.safe_load((REPO / "configs" / "cluster" / "local.yaml").read_text())
    users = config["provider"]["worker_ips"]
    assert PREFILL.ip in users and DECODE.ip in users and config["provider"]["head_ip"] == HEAD.ip, (
        "the demo's addresses must be configs/cluster/local.yaml's, whose start commands name them")
    config["cluster_name"] = CLUSTER_NAME
    config["provider"]["worker_ips"] = [PREFILL.ip, DECODE.ip]
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(ssh_key)}
    config["setup_commands"] = [
        # What `pip install` does on a real machine: this venv's torch and Ray, and the synced ~/raypd ahead of the
        # venv's own raypd (PYTHONPATH wins over an editable install). ray up runs each command in a login shell
        # that reads ~/.bashrc, so the environment holds for the start commands and `ray exec` too.
        f"echo 'export PATH={venv}/bin:$PATH PYTHONPATH=$HOME/raypd RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0' "
        ">> ~/.bashrc",
        *_kernel_setup(),
        "cd ~/raypd && python -m raypd.tools.tiny models/tiny-llama",
    ]
    return config


def _kernel_setup() -> list[str]:
    """What local.yaml's kernel build does: this machine's build of the C++ kernels (`make install` made it), else
    each node compiles them at its replicas' start, ~40 s, both nodes at once. The nodes reuse it as is: they run
    this venv, whose ninja made it (engine/model/kernels.py, _ninja_on_path). Nothing where the kernels do not build
    here: each node tries its own."""
    from engine.model.kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        return []
    return [f"echo 'export TORCH_EXTENSIONS_DIR={pathlib.Path(module.__file__).parent.parent}' >> ~/.bashrc"]


# configs/multinode.yaml asks for GPUs and a 7B model; on this CPU machine the tiny model, no GPUs, and no CPU slots
# (the three nodes share this machine's cores, as configs/local.yaml's roles share one host's). Placement stays the
# file's own: prefill replicas need the `prefill` resource, decode the `decode` one. A decode replica takes half the
# decode node's unit so that the demo can rescale to two on its one decode node.
SERVE_OVERRIDES: dict[str, Any] = {
    "model": "models/tiny-llama", "served_model_name": "tiny-llama", "dtype": "auto",
    "engine": {"device": "cpu", "kv_cache_bytes": "64MiB", "max_num_batched_tokens": 1024, "max_num_seqs": 32,
               "num_threads": 1},
    "prefill": {"replicas": 1, "num_gpus": 0, "num_cpus": 0},
    "decode": {"autoscaling": None, "replicas": 1, "num_gpus": 0, "num_cpus": 0, "resources": {"decode": 0.5}},
    "postproc": {"replicas": 2, "num_cpus": 0},
    "ingress": {"autoscaling": None, "replicas": 1, "num_cpus": 0},
}


def serve_config(decode_replicas: int) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "configs" / "multinode.yaml").read_text())
    config = _merge(config, SERVE_OVERRIDES)
    config["decode"]["replicas"] = decode_replicas
    return config


def _merge(base: dict, changes: dict) -> dict:
    """base with changes applied recursively; a None value removes the key."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "resources":
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
