"""Serving against vLLM: one workload through `vllm serve` (vLLM's CPU build, in its own venv), raypd's default
disaggregated deployment (`make serve`), the same with every prompt forced through a prefill replica and the KV
transfer ("forced"), and `mode: colocated`, one system at a time, at each concurrency.

    python -m benchmarks.serve_peers [--config configs/local.yaml] [--concurrency 1,16] [--num-requests 128]
                                  [--input-len 256] [--output-len 128] [--range-ratio 0.5]
                                  [--vllm-python .venv-vllm/bin/python]
                                  [--systems vllm,disaggregated,forced,colocated] [--dtype native]
                                  [--no-vllm-bench] [--repeats 1] [--plot FILE.png] [--json FILE]

The client is `raypd bench`'s (benchmarks.client), the same seeded prompts for every system, other prompts at each
concurrency and in each dtype's round (no round finds an earlier one's prompts cached); results print side by side
(TTFT / TPOT / ITL / E2E percentiles, throughput). vLLM is stopped before raypd's Ray starts. The client runs in a
process of its own for every system: raypd's Ray driver is this process.

Like against like by default (--dtype native): both systems in the dtype this CPU computes natively for the
checkpoint (engine.config.auto_dtype: bf16 with AMX-BF16 or AVX512-BF16, else fp32). Then, where either system's
default differs from that (vLLM serves a fp32 checkpoint in bf16 on any CPU, emulated where bf16 is not native), a
second round with each system's defaults. --dtype float32|bfloat16 runs that dtype only; --dtype defaults the
defaults only.

--repeats N runs the whole sequence (vLLM, then each raypd system) N times, each repeat on prompts of its own, and
ends with the medians over the repeats and their ratios to vLLM's: this VM's speed drifts by tens of percent within
minutes, and one repeat measures vLLM and raypd minutes apart.

`vllm bench serve` (vLLM's own client, from its venv) also runs against raypd's disaggregated endpoint at each
concurrency: --client-rounds times (3) with the openai backend (completions, as raypd bench sends them) on prompts from
raypd bench's own generator, other seeds, alternating with as many raypd bench runs, then once with the openai-chat
backend on vLLM's random dataset. Its TTFT/TPOT print beside `raypd bench`'s, run by run and as the ratio of the
medians: a check on the client (one run's TTFT p50 at 16 streams moves by tens of percent between runs).
`make bench-peers` creates vLLM's venv (see ../shared/BENCH.md for what it needs on this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import tempfile
import time

import httpx

from benchmarks.client import BenchResult, run_benchmark_apart
from benchmarks.workload import BenchConfig, make_workload
from benchmarks.report import format_table, plot_latency_cdfs, write_json
from cluster.config import RaypdConfig, load_config
from cluster.serving.ray_env import SERVE_LOGGING
from engine.config import auto_dtype, load_spec, run_dtype

READY_TIMEOUT_S = 300.0  # vLLM's CPU engine profiles and warms up before it listens
VLLM_CPU_DEFAULT_DTYPE = "bfloat16"  # what vllm serve runs a fp32 or bf16 checkpoint in on a CPU (../shared/BENCH.md)
TOKENS_PER_WORD = 1.35  # raypd bench's prompt words, in the tiny tokenizers' tokens (256 words ~ 345 tokens)


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
    """A local Ray with `raypd serve`'s settings (HAProxy, Serve's pace) on 127.0.0.1:port, for the deployments measured
    one after another."""
    from cluster.serving.ray_env import use_serve_env

    use_serve_env()  # as `raypd serve` runs it (before Serve is imported: it reads the settings once)
    import ray
    from ray import serve

    from cluster.serving.app import POSTPROC_NAMESPACE

    ray.init(include_dashboard=False, namespace=POSTPROC_NAMESPACE, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=SERVE_LOGGING)
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def raypd_app(config: RaypdConfig, mode: str):
    """The Serve application in `mode`, deployed as `raypd serve` deploys it (its /health beside it, Serve's access
    log off); yields its API root."""
    from ray import serve

    from cluster.serving.app import deploy

    deploy(deployment(config, mode), "raypd", "/", logging_config=SERVE_LOGGING)
    try:
        base = f"http://127.0.0.1:{config.http.port}/v1"
        wait_ready(base, None, READY_TIMEOUT_S)
        yield base
    finally:
        serve.delete("raypd")
        serve.delete("raypd-health")


def deployment(config: RaypdConfig, mode: str) -> RaypdConfig:
    """mode: disaggregated (the config as it is), colocated, or forced: disaggregated with every prompt through a
    prefill replica and the KV transfer (no conditional disaggregation: not when idle, not under a backlog)."""
    if mode != "forced":
        return config.model_copy(update={"mode": mode})
    router = config.router.model_copy(update={"local_prefill_when_idle": False, "max_prefill_backlog_tokens": 0,
                                              "max_local_prefill_tokens": 0})
    return config.model_copy(update={"mode": "disaggregated", "router": router})


def measure(label: str, base: str, bench: BenchConfig, concurrencies: list[int], api_key: str | None,
            results: dict[str, BenchResult]) -> None:
    for c in concurrencies:
        # Each concurrency its own prompts (the same for every system): a run must not find the last one's cached.
        config = dataclasses.replace(bench, base_url=base, concurrency=c, api_key=api_key, seed=bench.seed + c)
        result = run_benchmark_apart(config)  # raypd's Ray driver is this process: the client gets its own
        results[f"{label}, c={c}"] = result
        print(f"  {label} c={c}: {result.output_throughput:.0f} tok/s, TTFT p50 "
              f"{_p50(result, 'ttft')}, {result.failed} failed", flush=True)


def _p50(result: BenchResult, metric: str) -> str:
    p = result.latency_ms(metric)
    return "-" if p is None else f"{p.p50:.1f} ms"


def vllm_bench_serve(base: str, config: RaypdConfig, bench: BenchConfig, concurrency: int, vllm_python: str,
                     api_key: str | None, backend: str) -> dict:
    """`vllm bench serve` against base; its result JSON (completed, failed, median_ttft_ms, median_tpot_ms,
    output_throughput, ...). backend "openai": completions, as raypd bench sends them, on prompts from raypd bench's
    own generator (vLLM's custom dataset; another seed, so nothing is cached); "openai-chat": chat completions on
    vLLM's random dataset, in tokens of the workload's lengths."""
    vllm = pathlib.Path(vllm_python).absolute().parent / "vllm"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    seed = bench.seed + 7919 + concurrency
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(vllm), "bench", "serve", "--backend", backend, "--base-url", base.removesuffix("/v1"),
               "--model", config.model_name, "--tokenizer", str(pathlib.Path(config.model).absolute()),
               "--num-prompts", str(bench.num_requests), "--max-concurrency", str(concurrency), "--ignore-eos",
               "--seed", str(seed), "--num-warmups", str(bench.num_warmups), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", tmp,
               "--result-filename", "result.json"]
        if backend == "openai":
            dataset = pathlib.Path(tmp, "prompts.jsonl")
            dataset.write_text("".join(json.dumps({"prompt": s.prompt, "output_tokens": s.max_tokens}) + "\n"
                                       for s in make_workload(dataclasses.replace(bench, seed=seed))))
            cmd += ["--endpoint", "/v1/completions", "--dataset-name", "custom", "--dataset-path", str(dataset),
                    "--skip-chat-template", "--disable-shuffle"]
        else:
            cmd += ["--endpoint", "/v1/chat/completions", "--dataset-name", "random",
                    "--random-input-len", str(round(bench.input_len * TOKENS_PER_WORD)),
                    "--random-output-len", str(bench.output_len), "--random-range-ratio", str(bench.range_ratio)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        out = pathlib.Path(tmp, "result.json")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{proc.stdout[-1500:]}\n"
                               f"{proc.stderr[-2500:]}")
        return json.loads(out.read_text())


@dataclasses.dataclass(frozen=True)
class ClientRun:
    """One client's run against the endpoint: p50s and what completed."""
    ttft_ms: float
    tpot_ms: float
    tok_s: float
    ok: int
    failed: int

    @classmethod
    def of_raypd(cls, r: BenchResult) -> ClientRun:
        return cls(r.latency_ms("ttft").p50, r.latency_ms("tpot").p50, r.output_throughput, r.completed, r.failed)

    @classmethod
    def of_vllm(cls, j: dict) -> ClientRun:
        return cls(j["median_ttft_ms"], j["median_tpot_ms"], j["output_throughput"], j["completed"],
                   j.get("failed", 0))


def client_check(label: str, ours: list[ClientRun], theirs: list[ClientRun]) -> str:
    """vllm bench serve's and raypd bench's runs on the same endpoint, each run's TTFT/TPOT p50, and the ratio of the
    medians over the runs: one run's TTFT p50 at 16 streams moves by tens of percent from run to run."""
    def runs(rr: list[ClientRun]) -> str:
        return ", ".join(f"{r.ttft_ms:.1f}/{r.tpot_ms:.2f}" for r in rr)

    def med(rr: list[ClientRun], field: str) -> float:
        return statistics.median(getattr(r, field) for r in rr)

    return (f"{label}: vllm bench serve {sum(r.ok for r in theirs)} ok / {sum(r.failed for r in theirs)} failed; "
            f"TTFT/TPOT p50 ms per run: vllm bench {runs(theirs)} | raypd bench {runs(ours)} | vllm / raypd bench, "
            f"medians over the runs: TTFT {med(theirs, 'ttft_ms') / med(ours, 'ttft_ms'):.2f}x, TPOT "
            f"{med(theirs, 'tpot_ms') / med(ours, 'tpot_ms'):.2f}x, "
            f"tok/s {med(theirs, 'tok_s') / med(ours, 'tok_s'):.2f}x")


def check_clients(base: str, config: RaypdConfig, bench: BenchConfig, c: int, first: BenchResult, args,
                  api_key: str | None, label: str) -> list[str]:
    """`vllm bench serve` against base at concurrency c, alternating with raypd bench (first: raypd bench's run
    already measured here): --client-rounds runs of each with the openai backend (raypd bench's own prompt
    generator, other seeds), then one openai-chat run on vLLM's random dataset. Lines for client_check."""
    ours, theirs = [ClientRun.of_raypd(first)], []
    for i in range(args.client_rounds):
        theirs.append(ClientRun.of_vllm(vllm_bench_serve(base, config, dataclasses.replace(bench, seed=bench.seed + i),
                                                         c, args.vllm_python, api_key, "openai")))
        if i + 1 < args.client_rounds:
            again = dataclasses.replace(bench, base_url=base, concurrency=c, api_key=api_key,
                                        seed=bench.seed + 3571 + 100 * c + i)
            ours.append(ClientRun.of_raypd(run_benchmark_apart(again)))
    chat = ClientRun.of_vllm(vllm_bench_serve(base, config, bench, c, args.vllm_python, api_key, "openai-chat"))
    return [client_check(f"{label} c={c}, --backend openai, {len(theirs)} run(s) each, alternating", ours, theirs),
            client_check(f"{label} c={c}, --backend openai-chat (vLLM's random prompts), 1 run", ours, [chat])]


@dataclasses.dataclass(frozen=True)
class Round:
    name: str
    vllm_dtype: str | None  # vllm serve's --dtype; None: its default
    raypd_dtype: str | None  # raypd's config dtype; None: the config's own


def rounds(config: RaypdConfig, choice: str) -> list[Round]:
    """The dtype rounds --dtype asks for: native (like for like, then defaults where they differ), defaults, or one
    dtype for both."""
    checkpoint = load_spec(config.model).checkpoint_dtype
    if choice in ("float32", "bfloat16"):
        return [Round(f"both {choice}", choice, choice)]
    raypd_default = run_dtype(config.dtype, checkpoint, "cpu")
    defaults = Round(f"defaults (vLLM {VLLM_CPU_DEFAULT_DTYPE}, raypd {raypd_default})", None, None)
    if choice == "defaults":
        return [defaults]
    native = auto_dtype(checkpoint, "cpu")
    like = Round(f"like for like, both {native} (native here)", native, native)
    return [like] if (VLLM_CPU_DEFAULT_DTYPE, raypd_default) == (native, native) else [like, defaults]


def run(args, repeat: int = 0) -> dict[str, dict[str, BenchResult]]:
    """Per round: its results by label. raypd runs every round in one Ray (one deployment at a time). repeat: which
    repeat of the sequence this is (its prompts are its own)."""
    config = load_config(args.config)
    if args.model:
        config = config.model_copy(update={"model": args.model, "served_model_name": None})
    bench = BenchConfig(base_url="", model=config.model_name, num_requests=args.num_requests,
                        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                        num_warmups=2)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    plan = rounds(config, args.dtype)
    # Each round its own prompts: a later round must not find an earlier one's prompts in a cache.
    benches = [dataclasses.replace(bench, seed=bench.seed + 1000 * i + _REPEAT_SEED * repeat) for i in range(len(plan))]
    results: dict[str, dict[str, BenchResult]] = {r.name: {} for r in plan}
    checks: list[str] = []
    if "vllm" in systems:
        for r, b in zip(plan, benches):
            log = pathlib.Path(tempfile.gettempdir()) / "raypd-bench-vllm-serve.log"
            print(f"[{r.name}] vllm serve (log: {log})", flush=True)
            with vllm_server(config, args.vllm_python, log, r.vllm_dtype) as base:
                measure("vllm serve", base, b, concurrencies, None, results[r.name])
    modes = [m for m in ("disaggregated", "forced", "colocated") if m in systems]
    if modes:
        config = config.model_copy(update={"http": config.http.model_copy(update={"port": free_port()})})
        with raypd_serve(config.http.port):
            for r, b in zip(plan, benches):
                dtyped = config if r.raypd_dtype is None else config.model_copy(update={"dtype": r.raypd_dtype})
                for mode in modes:
                    print(f"[{r.name}] raypd {mode}", flush=True)
                    with raypd_app(dtyped, mode) as base:
                        key = dtyped.http.api_key_value()
                        measure(f"raypd {mode}", base, b, concurrencies, key, results[r.name])
                        if mode == "disaggregated" and args.vllm_bench and repeat == 0:
                            for c in concurrencies:
                                lines = check_clients(base, dtyped, b, c, results[r.name][f"raypd {mode}, c={c}"],
                                                      args, key, f"[{r.name}] raypd {mode}")
                                checks += lines
                                print("  " + "\n  ".join(lines), flush=True)
    for line in checks:
        print(line)
    return results


_REPEAT_SEED = 10007  # each repeat's prompts: seeds no other run of the sequence uses
SUMMARY = (("output tok/s", lambda r: r.output_throughput, "{:.0f}"), ("TTFT p50 ms", lambda r: _median_of(r, "ttft"),
           "{:.1f}"), ("TPOT p50 ms", lambda r: _median_of(r, "tpot"), "{:.2f}"))


def _median_of(result: BenchResult, metric: str) -> float:
    p = result.latency_ms(metric)
    return math.nan if p is None else p.p50  # no sample (every request failed): the summary says nan


def medians(repeats: list[dict[str, BenchResult]], reference: str = "vllm serve") -> str:
    """One dtype round's results over the repeats: per label and metric the median, each repeat's value, and the
    median's ratio to the reference system's at the same concurrency."""
    lines = [f"medians over {len(repeats)} repeats (each repeat's values in brackets); ratio to {reference}'s median"]
    for label in repeats[0]:
        system, _, conc = label.rpartition(", ")
        base = f"{reference}, {conc}"
        for name, get, form in SUMMARY:
            values = [get(rr[label]) for rr in repeats]
            median = statistics.median(values)
            ratio = ""
            if system != reference and base in repeats[0]:
                theirs = statistics.median(get(rr[base]) for rr in repeats)
                ratio = f"  {median / theirs:.2f}x" if theirs > 0 else "  -"  # 0 or nan: nothing of theirs completed
            each = ", ".join(form.format(v) for v in values)
            lines.append(f"  {label:<28} {name:<13} {form.format(median):>8}{ratio:<7} [{each}]")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--model", default=None, help="checkpoint to serve instead of the config's (a text model: "
                                                      "vLLM's CPU venv has no torchvision for image processors)")
    parser.add_argument("--concurrency", default="1,16")
    # 128: at 16 streams 8 waves, so the first (16 prompts at once) does not make half the samples, as with 32.
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256, help="prompt words (~ tokens)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths uniform in len*(1-r)..len*(1+r); 0: every request alike, so 16 streams start "
                             "and end in lockstep waves")
    parser.add_argument("--systems", default="vllm,disaggregated,forced,colocated")
    parser.add_argument("--dtype", choices=("native", "defaults", "float32", "bfloat16"), default="native",
                        help="native: like for like in this CPU's native dtype, then defaults where they differ")
    parser.add_argument("--no-vllm-bench", dest="vllm_bench", action="store_false",
                        help="skip `vllm bench serve` against raypd's disaggregated endpoint")
    parser.add_argument("--client-rounds", type=int, default=3,
                        help="runs of each client, alternating, in the vllm bench serve check (medians compared)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole sequence this many times and print the medians (the VM's speed drifts)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--plot", default=None, help="write latency CDFs here (PNG; one per dtype round, numbered)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    repeats = []
    for repeat in range(args.repeats):
        if args.repeats > 1:
            print(f"\n=== repeat {repeat + 1} of {args.repeats}", flush=True)
        repeats.append(run(args, repeat))
        for name, round_results in repeats[-1].items():
            print(f"\n{name}\n" + format_table(round_results), flush=True)
    if args.repeats > 1:
        for name in repeats[0]:
            print(f"\n{name}\n" + medians([rr[name] for rr in repeats]))
    if args.plot:
        for i, round_results in enumerate(repeats[0].values()):
            plot_latency_cdfs(round_results, args.plot if i == 0 else f"{args.plot}.{i}.png")
    if args.json:
        write_json({f"{'' if len(repeats) == 1 else f'repeat {k + 1}: '}{name}: {label}": r
                    for k, results in enumerate(repeats) for name, rr in results.items() for label, r in rr.items()},
                   args.json)


if __name__ == "__main__":
    main()
