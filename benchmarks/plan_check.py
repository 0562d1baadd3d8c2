"""`raypd plan` against the real deployment: calibrating the serving path, and checking the simulator's predictions.

Both run the Serve application of the YAML on a local Ray (1 prefill + 1 decode replica, or colocated with one
decode replica) and measure it with `raypd bench`'s client.
- calibrate: Poisson arrivals at two or more rates. What Serve measures beyond the simulated engine is the serving
  path: a decode step's slow-down (step_scale) and cost per sequence in it (seq_step_s), fitted so the simulated
  TPOT p50s match the measured ones (least squares on relative error: exactly with two rates, the best compromise
  with more); then the first token's trip (ttft_s) and what each request in flight (on average over the run)
  adds to it (ttft_per_request_s), so the TTFT p50s do. On a shared host these absorb the replicas' contention for
  its cores, which the simulator does not model otherwise, and that contention is not linear in load: more rates let
  the fit follow the curve instead of two points of it. The fit's own residuals are printed.
- validate: Poisson arrivals at each given rate; predicted and measured TTFT / TPOT p50 side by side. With other
  rates (and prompts) than the calibration's, the check is out of sample.
Every run has prompts of its own (a seed of its own; the simulator gets the same ones): on a deployment that served
them before, a run would find them in the prefix cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from typing import Iterator

from benchmarks.client import BenchResult, run_benchmark
from benchmarks.workload import BenchConfig
from cluster.config import RaypdConfig
from cluster.planning.plan import MODES, Profile, Workload, requests_of, simulate
from cluster.planning.simulator import Overheads

_WARMUP_REQUESTS = 6
CALIBRATION_REQUESTS = 80


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


def _prefill_replicas(mode: str) -> int:
    """Prefill replicas of the deployment the checks run for a mode (colocated: none; decode is always one)."""
    return 0 if mode == "colocated" else 1


@contextlib.contextmanager
def serving(config: RaypdConfig) -> Iterator:
    """A local Ray with Serve; yields measure(mode, bench) -> BenchResult, deploying each mode in turn."""
    import ray
    from ray import serve

    from cluster.serving.app import POSTPROC_NAMESPACE, build_from_config

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


def calibrate(profile: Profile, config: RaypdConfig, workload: Workload, rates: tuple[float, ...],
              measure) -> Profile:
    """The profile with each mode's serving-path overheads, from runs of the workload at two or more Poisson rates."""
    if len(rates) < 2:
        raise ValueError(f"calibration needs at least two request rates, got {list(rates)}")
    overheads = {}
    for mode in MODES:
        points = []
        for i, rate in enumerate(rates):
            run = dataclasses.replace(workload, request_rate=rate, num_requests=CALIBRATION_REQUESTS,
                                      seed=workload.seed + 1 + i)
            got = measure(mode, run.bench_config(config.model_name))
            points.append((requests_of(run, config), got.latency_ms("ttft").p50, got.latency_ms("tpot").p50))
            print(f"calibration, {mode}, {rate:g} req/s: measured TTFT p50 {points[-1][1]:.1f} ms, "
                  f"TPOT p50 {points[-1][2]:.2f} ms", flush=True)
        overheads[mode] = _fit_overheads(profile, mode, points)
        fitted = dataclasses.replace(profile, overheads={mode: overheads[mode]})
        for rate, (reqs, ttft, tpot) in zip(rates, points):
            sim = simulate(fitted, reqs, _prefill_replicas(mode), 1)
            print(f"  fitted, {mode}, {rate:g} req/s: TTFT p50 {sim.ttft_ms.p50:.1f} ms "
                  f"({Check.error(sim.ttft_ms.p50, ttft):+.0%}), TPOT p50 {sim.tpot_ms.p50:.2f} ms "
                  f"({Check.error(sim.tpot_ms.p50, tpot):+.0%})", flush=True)
    return dataclasses.replace(profile, overheads=overheads)


def _fit_overheads(profile: Profile, mode: str, points) -> Overheads:
    """The decode-step terms (step_scale, seq_step_s) so the simulated TPOT p50s match the measured ones, then the
    TTFT terms (ttft_s, ttft_per_request_s) so the TTFT p50s do."""
    p = _prefill_replicas(mode)

    def p50s(o: Overheads, metric: str) -> list[float]:
        trial = dataclasses.replace(profile, overheads={mode: o})
        return [getattr(simulate(trial, reqs, p, 1), metric).p50 for reqs, *_ in points]

    fitted = _fit2(lambda a, b: p50s(Overheads(0.0, a, b), "tpot_ms"), [tpot for *_, tpot in points],
                   (1.0, 0.0), (0.1, 1e-4), (0.5, 0.0))
    o = Overheads(0.0, *fitted)
    ttft = _fit2(lambda a, b: p50s(dataclasses.replace(o, ttft_s=a, ttft_per_request_s=b), "ttft_ms"),
                 [ttft for _, ttft, _ in points], (0.0, 0.0), (1e-3, 1e-3), (0.0, 0.0))
    return dataclasses.replace(o, ttft_s=ttft[0], ttft_per_request_s=ttft[1])


def _fit2(f, target: list[float], start: tuple[float, float], delta: tuple[float, float],
          floor: tuple[float, float], iterations: int = 8) -> tuple[float, float]:
    """Two parameters (a, b) with f(a, b) ~ target (simulated p50s against measured ones, two or more): Gauss-Newton
    steps on a finite-difference Jacobian of the relative residuals, each parameter kept >= its floor. Near
    saturation the simulated batches grow with slower steps, so f is steep and not smooth: a step that does not
    lower the squared error is halved (up to 6 times), and the best point seen is returned."""
    import numpy as np

    goal = np.array(target)

    def residual(a: float, b: float) -> np.ndarray:
        return np.array(f(a, b)) / goal - 1

    a, b = start
    base = residual(a, b)
    error = float(np.sum(base ** 2))
    for _ in range(iterations):
        jacobian = np.stack([(residual(a + delta[0], b) - base) / delta[0],
                             (residual(a, b + delta[1]) - base) / delta[1]], axis=1)  # (n, 2)
        step = np.linalg.lstsq(jacobian, -base, rcond=None)[0]
        for _ in range(7):
            na, nb = max(floor[0], a + step[0]), max(floor[1], b + step[1])
            trial = residual(na, nb)
            if float(np.sum(trial ** 2)) < error:
                a, b, base, error = na, nb, trial, float(np.sum(trial ** 2))
                break
            step = step / 2
        else:
            break  # no step along this direction helps: the best point is this one
    return float(a), float(b)


def validate(profile: Profile, config: RaypdConfig, workload: Workload, rates: list[float], measure) -> list[Check]:
    checks = []
    for mode in MODES:
        for i, rate in enumerate(rates):
            at_rate = dataclasses.replace(workload, request_rate=rate, seed=workload.seed + 100 + i)
            predicted = simulate(profile, requests_of(at_rate, config), _prefill_replicas(mode), 1)
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
