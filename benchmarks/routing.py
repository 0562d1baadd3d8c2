"""Routing policies side by side on the multi-turn chat workload: `python -m benchmarks.routing`.

The YAML's deployment with N prefill replicas (2 unless --prefill-replicas) and 1 decode replica is started fresh
for each policy (empty caches), warmed up with other prompts, then sent the same seeded chat workload (`raypd bench
--workload chat`). Per policy: the prefill role's prefix-cache hit rate over the run (its hit / looked-up prompt
tokens, summed over the replicas from the replica directory), the share of prompt tokens the responses report cached
(any role), TTFT and TPOT p50 / p90. A benchmark, not a test.

What a load-only (content-blind) policy can reach is bounded: a turn lands on the replica that served the
conversation's previous turn with probability 1/N, and then hits what prefix-aware would; every turn hits the shared
system prompt wherever it lands. With prefix-aware's hit rate h and the system prompt's share s of looked-up tokens,
a load-only policy keeps at least s + (h - s) / N, so prefix-aware's advantage is at most h / (s + (h - s) / N):
below 2x for N = 2 whenever s > 0. Every run prints it (`blind_floor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks.client import BenchResult
from benchmarks.workload import BenchConfig
from cluster.config import RaypdConfig, RouterPolicy, load_config
from benchmarks.plan_check import _free_port

POLICIES = ("least_queued_tokens", "power_of_two_choices", "prefix_aware")
_SETTLE_S = 1.2  # > the directory's refresh period


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    name: str
    prefill_hit_rate: float
    result: BenchResult
    query_tokens: float = 0.0  # prompt tokens the prefill role looked up over the run


def system_share(config: RaypdConfig, bench: BenchConfig, query_tokens: float) -> float:
    """The share of looked-up prompt tokens that are the shared system prompt's full blocks (every turn has them)."""
    from transformers import AutoTokenizer

    from benchmarks.workload import system_prompt

    tokens = len(AutoTokenizer.from_pretrained(config.model).encode(system_prompt(bench)))
    block = config.engine.block_size
    return (tokens // block) * block * bench.num_requests / max(1.0, query_tokens)


def blind_floor(prefix_aware_hit: float, share: float, replicas: int) -> float:
    """The least a load-only policy's hit rate can be, given prefix-aware's (module docstring)."""
    return share + (prefix_aware_hit - share) / replicas


def deployment(config: RaypdConfig, policy: str, max_local_prefill_tokens: int, kv_cache_bytes: int | None,
               prefill_kv_cache_bytes: int | None = None, prefill_replicas: int = 2):
    one = {"replicas": 1, "autoscaling": None}
    engine = config.engine if kv_cache_bytes is None else config.engine.model_copy(
        update={"kv_cache_bytes": kv_cache_bytes, "num_blocks": None})
    prefill_pool = {} if prefill_kv_cache_bytes is None else {"kv_cache_bytes": prefill_kv_cache_bytes}
    return config.model_copy(update={
        "mode": "disaggregated", "engine": engine,
        "prefill": config.prefill.model_copy(update={**one, "replicas": prefill_replicas, **prefill_pool}),
        "decode": config.decode.model_copy(update=one),
        "router": config.router.model_copy(update={"policy": RouterPolicy(policy),
                                                   "max_local_prefill_tokens": max_local_prefill_tokens})})


def _prefill_totals(directory, replicas: int) -> tuple[float, float]:
    """(hit, query) prompt tokens of the prefill role, once the directory has stopped moving."""
    last = None
    while True:
        totals = directory.totals("prefill")
        now = (totals.get("prefix_cache_hit_tokens", 0.0), totals.get("prefix_cache_query_tokens", 0.0))
        if now == last and totals.get("replicas") == replicas:
            return now
        last = now
        time.sleep(_SETTLE_S)


def run(config: RaypdConfig, bench: BenchConfig, runs: list[tuple[str, str, int]],
        kv_cache_bytes: int | None, prefill_kv_cache_bytes: int | None = None,
        prefill_replicas: int = 2) -> list[PolicyRun]:
    import ray
    from ray import serve

    from cluster.serving.app import POSTPROC_NAMESPACE, build_from_config
    from benchmarks.client import run_benchmark
    from cluster.serving.directory import Directory

    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    ray.init(include_dashboard=False, namespace=POSTPROC_NAMESPACE, log_to_driver=False)
    out = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, policy, local in runs:
            serve.run(build_from_config(deployment(config, policy, local, kv_cache_bytes, prefill_kv_cache_bytes,
                                                       prefill_replicas)),
                      name="raypd", route_prefix="/")
            warm = dataclasses.replace(bench, base_url=url, workload="random", num_requests=6, concurrency=1,
                                       seed=bench.seed + 1000, input_len=32)
            run_benchmark(warm)
            directory = Directory("raypd")
            hit0, query0 = _prefill_totals(directory, prefill_replicas)
            result = run_benchmark(dataclasses.replace(bench, base_url=url))
            hit1, query1 = _prefill_totals(directory, prefill_replicas)
            out.append(PolicyRun(name, (hit1 - hit0) / max(1.0, query1 - query0), result, query1 - query0))
            print(f"{name}: done ({result.failed} failed)", flush=True)
            serve.delete("raypd")  # the next policy starts from empty caches
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


def format_runs(runs: list[PolicyRun]) -> str:
    lines = ["| policy | prefill cache hit rate | prompt tokens cached (all roles) | TTFT p50 | TTFT p90 | TPOT p50 | "
             "failed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        ttft, tpot = r.result.latency_ms("ttft"), r.result.latency_ms("tpot")
        lines.append(f"| {r.name} | {r.prefill_hit_rate:.1%} | {r.result.cache_hit_rate or 0:.1%} | "
                     f"{ttft.p50:.1f} ms | {ttft.p90:.1f} ms | {tpot.p50:.2f} ms | {r.result.failed} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="each engine's KV pool (default: the YAML's)")
    parser.add_argument("--prefill-kv-cache-bytes", type=int, default=None,
                        help="each prefill replica's KV pool, its prefix cache (default: the engines')")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=64, help="words of the shared system prompt")
    parser.add_argument("--input-len", type=int, default=48, help="words per user message")
    parser.add_argument("--output-len", type=int, default=48, help="tokens per reply")
    parser.add_argument("--prefill-replicas", type=int, default=2)
    parser.add_argument("--request-rate", type=float, default=4.0, help="conversations starting per second")
    parser.add_argument("--local-below", type=int, default=64, help="also run prefix_aware with this "
                                                                    "router.max_local_prefill_tokens (0: skip)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    bench = BenchConfig("", config.model_name, num_requests=args.conversations * args.turns,
                        request_rate=args.request_rate, input_len=args.input_len, output_len=args.output_len,
                        workload="chat", num_turns=args.turns, system_len=args.system_len, request_timeout_s=120)
    runs = [(policy, policy, 0) for policy in POLICIES]
    if args.local_below:
        runs.append((f"prefix_aware + local prefill under {args.local_below} tokens", "prefix_aware",
                     args.local_below))
    results = run(config, bench, runs, args.kv_cache_bytes, args.prefill_kv_cache_bytes, args.prefill_replicas)
    print(f"\n{args.conversations} conversations x {args.turns} turns, system prompt {args.system_len} words, user "
          f"messages {args.input_len} words, replies {args.output_len} tokens, {args.request_rate:g} conversations/s; "
          f"{args.prefill_replicas} prefill + 1 decode replicas, "
          f"KV pool {args.kv_cache_bytes or config.engine.kv_cache_bytes} bytes each"
          f"{'' if args.prefill_kv_cache_bytes is None else f', prefill {args.prefill_kv_cache_bytes} bytes'}\n")
    print(format_runs(results))
    aware = next(r for r in results if r.name == "prefix_aware")
    share = system_share(config, bench, aware.query_tokens)
    blind = [r for r in results if r.name in POLICIES and r.name != "prefix_aware"]
    floor = blind_floor(aware.prefill_hit_rate, share, args.prefill_replicas)
    print(f"\nsystem prompt: {share:.1%} of looked-up tokens; a load-only policy on {args.prefill_replicas} replicas "
          f"keeps at least {floor:.1%}, so prefix-aware can lead by at most {aware.prefill_hit_rate / floor:.2f}x; "
          f"measured "
          + ", ".join(f"{aware.prefill_hit_rate / max(r.prefill_hit_rate, 1e-9):.2f}x {r.name}" for r in blind))


if __name__ == "__main__":
    main()
