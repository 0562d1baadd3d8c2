"""`raypd plan` against the real deployment: calibrating the serving path, and checking the simulator's predictions.

Both run the Serve application of the YAML on a local Ray (1 prefill + 1 decode replica, or colocated with one
decode replica) and measure it with `raypd bench`'s client.
- calibrate: closed-loop runs at concurrency 1 and 4 (no arrival process). What Serve measures beyond the simulated
  engine is the serving path: a decode step's slow-down (step_scale) and cost per sequence in it (seq_step_s),
  fitted so both simulated TPOT p50s match, then ttft = measured TTFT p50 - simulated at concurrency 1.
- validate: Poisson arrivals at each given rate; predicted and measured TTFT / TPOT p50 side by side. The rates are
  not the calibration's, so the check is out of sample: queueing, batching and chunking are the simulator's own.
Every run has prompts of its own (a seed of its own; the simulator gets the same ones): on a deployment that served
them before, a run would find them in the prefix cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from typing import Iterator

from cluster.bench import BenchConfig, BenchResult, run_benchmark
from cluster.config import RaypdConfig
from cluster.plan import MODES, Profile, Workload, requests_of, simulate
from cluster.simulator import Overheads

_WARMUP_REQUESTS = 6
CALIBRATION_CONCURRENCY = 4
CALIBRATION_REQUESTS = 40


@dataclasses.dataclass(frozen=True)
class Check:
    mode: str
    rate: float
    predicted_ttft_ms: float
    measured_ttft_ms: float
    predicted_tpot_ms: float
    measured_tpot_ms: float

    @staticmethod
    def error(predicted: float, measured: float) -> float:
        return predicted / measured - 1


def deployment(config: RaypdConfig, mode: str) -> RaypdConfig:
    """The YAML's deployment as the plan checks it: one replica per role."""
    one = {"replicas": 1, "autoscaling": None}
    return config.model_copy(update={"mode": mode, "prefill": config.prefill.model_copy(update=one),
                                     "decode": config.decode.model_copy(update=one)})


@contextlib.contextmanager
def serving(config: RaypdConfig) -> Iterator:
    """A local Ray with Serve; yields measure(mode, bench) -> BenchResult, deploying each mode in turn."""
    import ray
    from ray import serve

    from cluster.app import POSTPROC_NAMESPACE, build_from_config

    port = _free_port()
    ray.init(include_dashboard=False, namespace=POSTPROC_NAMESPACE, log_to_driver=False)
    deployed: list[str] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def measure(mode: str, bench: BenchConfig) -> BenchResult:
            if deployed[-1:] != [mode]:
                if deployed:
                    serve.delete("raypd")
                serve.run(build_from_config(deployment(config, mode)), name="raypd", route_prefix="/")
                deployed.append(mode)
                _warm_up(config, bench, port)
            return run_benchmark(dataclasses.replace(bench, base_url=f"http://127.0.0.1:{port}/v1",
                                                     api_key=config.http.api_key_value()))

        yield measure
    finally:
        serve.shutdown()
        ray.shutdown()


def _warm_up(config: RaypdConfig, bench: BenchConfig, port: int) -> None:
    # other prompts than the measured ones (another seed), so the measured run finds none of them cached
    warm = dataclasses.replace(bench, base_url=f"http://127.0.0.1:{port}/v1", api_key=config.http.api_key_value(),
                               num_requests=_WARMUP_REQUESTS, concurrency=1, seed=bench.seed + 1000)
    run_benchmark(warm)


def calibrate(profile: Profile, config: RaypdConfig, workload: Workload, measure) -> Profile:
    """The profile with each mode's serving-path overheads, from closed-loop runs of the workload's length mix at
    concurrency 1 and CALIBRATION_CONCURRENCY."""
    overheads = {}
    for mode in MODES:
        points = []
        for concurrency in (1, CALIBRATION_CONCURRENCY):
            closed = dataclasses.replace(workload, concurrency=concurrency, request_rate=float("inf"),
                                         num_requests=CALIBRATION_REQUESTS, seed=workload.seed + concurrency)
            got = measure(mode, closed.bench_config(config.model_name))
            points.append((requests_of(closed, config), concurrency, got.latency_ms("ttft").p50,
                           got.latency_ms("tpot").p50))
            print(f"calibration, {mode}, concurrency {concurrency}: measured TTFT p50 {points[-1][2]:.1f} ms, "
                  f"TPOT p50 {points[-1][3]:.2f} ms", flush=True)
        overheads[mode] = _fit_overheads(profile, mode, points)
    return dataclasses.replace(profile, overheads=overheads)


def _fit_overheads(profile: Profile, mode: str, points) -> Overheads:
    """step_scale and seq_step_s so the simulated TPOT p50 matches both measured ones (Newton steps: the batches
    shift with the speeds), then ttft_s so the TTFT p50 matches at concurrency 1."""
    import numpy as np

    p = 0 if mode == "colocated" else 1

    def tpots(scale: float, seq: float) -> np.ndarray:  # (len(points),) simulated TPOT p50s, ms
        trial = dataclasses.replace(profile, overheads={mode: Overheads(0.0, scale, seq)})
        return np.array([simulate(trial, reqs, p, 1, concurrency=c).tpot_ms.p50 for reqs, c, _, _ in points])

    measured = np.array([tpot for *_, tpot in points])  # (len(points),)
    scale, seq = 1.0, 0.0
    for _ in range(4):
        base = tpots(scale, seq)
        jacobian = np.stack([(tpots(scale * 1.1, seq) - base) / (0.1 * scale),
                             (tpots(scale, seq + 1e-4) - base) / 1e-4], axis=1)  # (len(points), 2)
        step = np.linalg.lstsq(jacobian, measured - base, rcond=None)[0]
        scale, seq = max(0.5, scale + step[0]), max(0.0, seq + step[1])
    alone, _, ttft, _ = points[0]
    fitted = dataclasses.replace(profile, overheads={mode: Overheads(0.0, scale, seq)})
    extra = ttft - simulate(fitted, alone, p, 1, concurrency=1).ttft_ms.p50
    return Overheads(max(0.0, extra) / 1e3, scale, seq)


def validate(profile: Profile, config: RaypdConfig, workload: Workload, rates: list[float], measure) -> list[Check]:
    checks = []
    for mode in MODES:
        for i, rate in enumerate(rates):
            at_rate = dataclasses.replace(workload, request_rate=rate, seed=workload.seed + 100 + i)
            predicted = simulate(profile, requests_of(at_rate, config), 0 if mode == "colocated" else 1, 1)
            got = measure(mode, at_rate.bench_config(config.model_name))
            if got.failed:
                raise RuntimeError(f"{mode} at {rate} req/s: {got.failed} requests failed: {got.errors()[:3]}")
            checks.append(Check(mode, rate, predicted.ttft_ms.p50, got.latency_ms("ttft").p50,
                                predicted.tpot_ms.p50, got.latency_ms("tpot").p50))
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = ["| deployment | rate req/s | TTFT p50 predicted | TTFT p50 measured | error | TPOT p50 predicted | "
             "TPOT p50 measured | error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in checks:
        name = "1 prefill + 1 decode" if c.mode == "disaggregated" else "colocated (1 decode)"
        lines.append(f"| {name} | {c.rate:g} | {c.predicted_ttft_ms:.1f} ms | {c.measured_ttft_ms:.1f} ms | "
                     f"{Check.error(c.predicted_ttft_ms, c.measured_ttft_ms):+.0%} | {c.predicted_tpot_ms:.2f} ms | "
                     f"{c.measured_tpot_ms:.2f} ms | {Check.error(c.predicted_tpot_ms, c.measured_tpot_ms):+.0%} |")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
