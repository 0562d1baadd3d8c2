"""The same workload through the Serve deployment (disaggregated, then colocated; OpenAI over HTTP) and through the
embedded engine, side by side in one process: `python -m benchmarks.serve_compare [--config configs/local.yaml]`.

The embedded engine is timed the way the HTTP client times the server: from submitting a request to its first and
last streamed token, so the difference is what the cluster path adds (HTTP, Ray, the KV transfer, the postproc hop).
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import time

from benchmarks.client import BenchResult, RequestRecord, run_benchmark
from benchmarks.workload import BenchConfig, make_workload
from benchmarks.report import format_table
from cluster.config import RaypdConfig, load_config
from raypd import LLM, SamplingParams


def embedded(config: RaypdConfig, bench: BenchConfig) -> BenchResult:
    """One request at a time through LLM.generate_async(streaming=True), like a client with concurrency 1."""
    with LLM(config.model, config.engine_config()) as llm:
        specs = make_workload(bench)
        for spec in specs[: bench.num_warmups]:
            llm.generate(spec.prompt, SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True))
        start = time.perf_counter()
        records = [_one(llm, spec) for spec in specs]
        return BenchResult(bench, time.perf_counter() - start, records)


def _one(llm: LLM, spec) -> RequestRecord:
    record = RequestRecord(spec.prompt_words, spec.max_tokens)
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=1.0, ignore_eos=True)
    start = last = time.perf_counter()
    for step in llm.generate_async(spec.prompt, params, streaming=True):
        if step.outputs[0].text_diff:
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            last = now
    record.e2e_s, record.ok = time.perf_counter() - start, True
    record.output_tokens = len(step.outputs[0].token_ids)
    return record


def served(config: RaypdConfig, bench: BenchConfig) -> dict[str, BenchResult]:
    """The workload through the Serve app, disaggregated and then colocated, in one local Ray."""
    import ray
    from ray import serve

    from cluster.serving.app import POSTPROC_NAMESPACE, build_from_config

    ray.init(include_dashboard=False, namespace=POSTPROC_NAMESPACE, log_to_driver=False)
    results = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": config.http.port})
        for mode in ("disaggregated", "colocated"):
            serve.run(build_from_config(config.model_copy(update={"mode": mode})), name="raypd", route_prefix="/")
            results[f"serve, {mode}"] = run_benchmark(dataclasses.replace(
                bench, base_url=f"http://127.0.0.1:{config.http.port}/v1", api_key=config.http.api_key_value()))
            serve.delete("raypd")
        return results
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    config = config.model_copy(update={"http": config.http.model_copy(update={"port": _free_port()})})
    bench = BenchConfig(base_url="", model=config.model_name, num_requests=args.num_requests, concurrency=1,
                        input_len=args.input_len, output_len=args.output_len, num_warmups=3)
    results = {"embedded engine": embedded(config, bench), **served(config, bench)}
    print(format_table(results))
    emb, srv = results["embedded engine"].latency_ms, results["serve, disaggregated"].latency_ms
    print(f"\nTTFT overhead p50: {srv('ttft').p50 - emb('ttft').p50:+.1f} ms (target <= 10 ms); "
          f"TPOT overhead p50: {100 * (srv('tpot').p50 / emb('tpot').p50 - 1):+.1f}% (target <= 10%)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
