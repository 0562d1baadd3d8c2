"""Serving against vLLM: one workload through `vllm serve` (vLLM's CPU build, in its own venv), raypd's default
disaggregated deployment (`make serve`) and `mode: colocated`, one system at a time, at each concurrency.

    python -m benchmarks.serve_peers [--config configs/local.yaml] [--concurrency 1,16] [--num-requests 32]
                                  [--input-len 256] [--output-len 128] [--vllm-python .venv-vllm/bin/python]
                                  [--systems vllm,disaggregated,colocated] [--dtype bfloat16]
                                  [--plot FILE.png] [--json FILE]

The client is `raypd bench`'s (benchmarks.client), the same seeded prompts for every system, other prompts at each
concurrency (none found cached from the run before); results print side by side (TTFT / TPOT / ITL / E2E
percentiles, throughput). vLLM is stopped before raypd's Ray starts. Without --dtype each system keeps its own
default: on a CPU with AMX-BF16 both serve a fp32 checkpoint in bf16 (raypd's `dtype: auto`, engine.config.auto_dtype).
--dtype runs both in that dtype. `make bench-peers` creates vLLM's venv (see ../shared/BENCH.md for what it needs on
this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import socket
import subprocess
import tempfile
import time

import httpx

from benchmarks.client import BenchResult, run_benchmark
from benchmarks.workload import BenchConfig
from benchmarks.report import format_table, plot_latency_cdfs, write_json
from cluster.config import RaypdConfig, load_config

READY_TIMEOUT_S = 300.0  # vLLM's CPU engine profiles and warms up before it listens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen | None, deadline_s: float) -> None:
    """Polls GET /models until it answers 200; raises if the server exits or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/models", timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} was not ready within {deadline_s:.0f} s")


@contextlib.contextmanager
def vllm_server(config: RaypdConfig, vllm_python: str, log_path: pathlib.Path, dtype: str | None = None):
    """`vllm serve` on the same checkpoint, its defaults otherwise (dtype too unless given); yields its API root."""
    vllm = pathlib.Path(vllm_python).absolute().parent / "vllm"
    if not vllm.exists():
        raise SystemExit(f"no {vllm}: `make bench-peers` creates vLLM's venv")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env["VLLM_TARGET_DEVICE"] = "cpu"
    cmd = [str(vllm), "serve", config.model, "--served-model-name", config.model_name, "--port", str(port),
           "--max-model-len", "2048", "--enforce-eager"] + (["--dtype", dtype] if dtype else [])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            wait_ready(base, proc, READY_TIMEOUT_S)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


@contextlib.contextmanager
def raypd_serve(port: int):
    """A local Ray with HAProxy (as `raypd serve`) on 127.0.0.1:port, for the deployments measured one after another."""
    from cluster.serving.haproxy import use_haproxy

    use_haproxy()  # as `raypd serve` runs it (before Serve is imported: it reads the setting once)
    import ray
    from ray import serve

    from cluster.serving.app import POSTPROC_NAMESPACE

    ray.init(include_dashboard=False, namespace=POSTPROC_NAMESPACE, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def raypd_app(config: RaypdConfig, mode: str):
    """The Serve application in `mode` (as benchmarks.serve_compare runs it); yields its API root."""
    from ray import serve

    from cluster.serving.app import build_from_config

    serve.run(build_from_config(config.model_copy(update={"mode": mode})), name="raypd", route_prefix="/")
    try:
        base = f"http://127.0.0.1:{config.http.port}/v1"
        wait_ready(base, None, READY_TIMEOUT_S)
        yield base
    finally:
        serve.delete("raypd")


def measure(label: str, base: str, bench: BenchConfig, concurrencies: list[int], api_key: str | None,
            results: dict[str, BenchResult]) -> None:
    for c in concurrencies:
        # Each concurrency its own prompts (the same for every system): a run must not find the last one's cached.
        config = dataclasses.replace(bench, base_url=base, concurrency=c, api_key=api_key, seed=bench.seed + c)
        result = run_benchmark(config)
        results[f"{label}, c={c}"] = result
        print(f"  {label} c={c}: {result.output_throughput:.0f} tok/s, TTFT p50 "
              f"{_p50(result, 'ttft')}, {result.failed} failed", flush=True)


def _p50(result: BenchResult, metric: str) -> str:
    p = result.latency_ms(metric)
    return "-" if p is None else f"{p.p50:.1f} ms"


def run(args) -> dict[str, BenchResult]:
    config = load_config(args.config)
    if args.model:
        config = config.model_copy(update={"model": args.model, "served_model_name": None})
    if args.dtype:
        config = config.model_copy(update={"dtype": args.dtype})
    bench = BenchConfig(base_url="", model=config.model_name, num_requests=args.num_requests,
                        input_len=args.input_len, output_len=args.output_len, num_warmups=2)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    results: dict[str, BenchResult] = {}
    if "vllm" in systems:
        log = pathlib.Path(tempfile.gettempdir()) / "raypd-bench-vllm-serve.log"
        print(f"vllm serve (log: {log})", flush=True)
        with vllm_server(config, args.vllm_python, log, args.dtype) as base:
            measure("vllm serve", base, bench, concurrencies, None, results)
    modes = [m for m in ("disaggregated", "colocated") if m in systems]
    if modes:
        config = config.model_copy(update={"http": config.http.model_copy(update={"port": free_port()})})
        with raypd_serve(config.http.port):
            for mode in modes:
                print(f"raypd {mode}", flush=True)
                with raypd_app(config, mode) as base:
                    measure(f"raypd {mode}", base, bench, concurrencies, config.http.api_key_value(), results)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--model", default=None, help="checkpoint to serve instead of the config's (a text model: "
                                                      "vLLM's CPU venv has no torchvision for image processors)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256, help="prompt words (~ tokens)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--systems", default="vllm,disaggregated,colocated")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="serve both systems in this dtype (default: each its own default)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--plot", default=None, help="write latency CDFs here (PNG)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    args = parser.parse_args(argv)
    results = run(args)
    print("\n" + format_table(results))
    if args.plot:
        plot_latency_cdfs(results, args.plot)
    if args.json:
        write_json(results, args.json)


if __name__ == "__main__":
    main()
