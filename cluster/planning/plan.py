"""`raypd plan`: how many prefill and decode replicas a workload needs, from this hardware's own numbers.

1. Profile: the configured model runs in-process (an engine with the YAML's settings and threads); every step of a
   grid of prefill batches (prompt lengths x batch sizes, chunked past the token budget) and decode batches (batch
   sizes x context lengths), plus mixed steps, is timed, and a StepModel (cluster/planning/simulator.py) is fitted to
   them by least squares on relative error.
2. Calibrate (optional, --calibrate RATE RATE...; benchmarks/plan_check.py): runs through the Serve deployment at two
   or more rates, per mode, give what the serving path adds (TTFT overhead and its growth with requests in flight,
   decode step slow-down and cost per sequence); without it the engine alone is simulated.
3. Search: for each prefill count P (0 = colocated) and decode count D up to --max-replicas, the simulator runs the
   workload (Poisson arrivals at --request-rate, the bench's length mix, tokenized with the model's tokenizer); the
   counts whose requests meet both SLOs (TTFT and TPOT) for at least --attainment of requests, at the highest goodput
   per replica, are recommended, and written as a deployment YAML.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import random
import time
from dataclasses import dataclass

import yaml

from benchmarks.workload import BenchConfig, Percentiles, make_workload
from cluster.config import RaypdConfig
from cluster.planning.simulator import (FEATURES, EngineShape, Overheads, SimRecord, SimRequest, Simulation, StepModel,
                               step_features)

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Profile:
    model: str
    shape: EngineShape
    step_model: StepModel
    fit_error: float  # median |predicted - measured| / measured over the profiled steps
    num_steps: int
    threads: int | None
    overheads: dict[str, Overheads] = dataclasses.field(default_factory=dict)  # per mode, when calibrated

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        return cls(data["model"], EngineShape(**data["shape"]), StepModel(tuple(data["step_model"]["coefficients"])),
                   data["fit_error"], data["num_steps"], data["threads"],
                   {mode: Overheads(**o) for mode, o in data.get("overheads", {}).items()})

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Profile:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))


# ---- 1. profile ----
@dataclass(frozen=True)
class Grid:
    """The batches profiled (those the engine's limits allow)."""

    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 1536)
    prefill_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (32, 128, 512, 1024)
    mixed: tuple[tuple[int, int, int], ...] = ((4, 128, 256), (16, 128, 512), (32, 256, 128))  # (batch, ctx, prompt)
    repeats: int = 2


DECODE_STEPS = 6  # decode steps per (batch, context)


def profile(config: RaypdConfig, grid: Grid = Grid()) -> Profile:
    """Times engine steps of the configured model on this machine and fits the step model."""
    import torch

    from engine.core.engine import LLMEngine

    engine_config = config.engine_config()
    if engine_config.num_threads:
        torch.set_num_threads(engine_config.num_threads)
    engine = LLMEngine(config.model, engine_config)
    rng, samples = random.Random(0), []
    limit = engine.spec.max_position_embeddings
    _run(engine, [(_prompt(rng, engine, 64), 4)] * 2, [])  # warm-up, not recorded
    for _ in range(grid.repeats):
        for length in (n for n in grid.prefill_lengths if n < limit):
            for batch in grid.prefill_batches:
                if batch * length <= 2 * engine_config.max_num_batched_tokens and batch <= engine_config.max_num_seqs:
                    _run(engine, [(_prompt(rng, engine, length), 1) for _ in range(batch)], samples)
        for context in (n for n in grid.decode_contexts if n + DECODE_STEPS < limit):
            for batch in (b for b in grid.decode_batches if b <= engine_config.max_num_seqs):
                _run(engine, [(_prompt(rng, engine, context), DECODE_STEPS) for _ in range(batch)], samples)
        _mixed(engine, rng, grid.mixed, samples)
    model, error = fit(samples)
    shape = EngineShape(engine_config.block_size, engine.block_manager.num_blocks,
                        engine_config.max_num_batched_tokens, engine_config.max_num_seqs,
                        engine_config.enable_prefix_caching, engine.block_manager.windows)
    return Profile(config.model_name, shape, model, error, len(samples), engine_config.num_threads)


def _prompt(rng: random.Random, engine, n: int) -> list[int]:
    return [rng.randrange(10, engine.spec.vocab_size) for _ in range(n)]


def _run(engine, requests: list[tuple[list[int], int]], samples: list) -> None:
    """Adds the requests at once and steps the engine until they are done, recording every step."""
    from llmapi.sampling_params import SamplingParams

    for prompt, max_tokens in requests:
        engine.add_request(_next_id(), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        samples.append(_timed_step(engine))


def _mixed(engine, rng: random.Random, mixes, samples: list) -> None:
    """Decode batches that a prompt joins mid-way (colocated steps: decode tokens and a prefill chunk together)."""
    from llmapi.sampling_params import SamplingParams

    for batch, context, length in mixes:
        params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(_next_id(), _prompt(rng, engine, context), params)
        for _ in range(3):
            samples.append(_timed_step(engine))
        engine.add_request(_next_id(), _prompt(rng, engine, length), params)
        while engine.has_unfinished_requests():
            samples.append(_timed_step(engine))


_ids = itertools.count()


def _next_id() -> int:
    return next(_ids)


def _timed_step(engine) -> tuple[tuple[float, ...], float]:
    """One engine step (LLMEngine.step less the KV connector poll, which a colocated engine does not need), timed,
    with the features of what it ran."""
    start = time.perf_counter()
    out = engine.scheduler.schedule()
    engine.output.update(out, engine.executor.execute(out))
    return step_features(out), time.perf_counter() - start


def fit(samples: list[tuple[tuple[float, ...], float]]) -> tuple[StepModel, float]:
    """Least squares on relative error (short decode steps count as much as long prefills), non-negative: a
    coefficient that would go negative is dropped and the rest refitted. Steps with the same features (the grid's
    repeats) count once, at their fastest time: another process sharing the cores only ever adds time. Returns the
    model and its median relative error on those steps."""
    import numpy as np

    fastest: dict[tuple[float, ...], float] = {}
    for f, t in samples:
        if f[1] > 0:
            fastest[f] = min(t, fastest.get(f, t))
    x = np.array(list(fastest))  # (num_steps, len(FEATURES))
    y = np.array(list(fastest.values()))  # (num_steps,)
    keep = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(len(FEATURES))
    full[keep] = coef
    error = float(np.median(np.abs(x @ full - y) / y))
    return StepModel(tuple(float(c) for c in full)), error


# ---- 2./3. simulate and search ----
@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = 4.0
    num_requests: int = 200
    seed: int = 0
    concurrency: int | None = None

    def bench_config(self, model_name: str) -> BenchConfig:
        return BenchConfig("http://unused/v1", model_name, num_requests=self.num_requests,
                           request_rate=self.request_rate, concurrency=self.concurrency, input_len=self.input_len,
                           output_len=self.output_len, range_ratio=self.range_ratio, seed=self.seed)


def requests_of(workload: Workload, config: RaypdConfig) -> list[SimRequest]:
    """The bench's own workload (same prompts, lengths and arrivals), tokenized as the ingress tokenizes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    return [SimRequest(spec.arrival_s, tuple(tokenizer.encode(spec.prompt)), spec.max_tokens)
            for spec in make_workload(workload.bench_config(config.model_name))]


@dataclass(frozen=True)
class Outcome:
    num_prefill: int
    num_decode: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    attainment: float  # share of requests within both SLOs
    goodput: float  # such requests per second
    duration_s: float

    @property
    def replicas(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def goodput_per_replica(self) -> float:
        return self.goodput / self.replicas


def simulate(profile: Profile, requests: list[SimRequest], num_prefill: int, num_decode: int,
             slo_ttft_ms: float = math.inf, slo_tpot_ms: float = math.inf,
             concurrency: int | None = None) -> Outcome:
    mode = "colocated" if num_prefill == 0 else "disaggregated"
    overheads = profile.overheads.get(mode, Overheads())
    records = Simulation(profile.shape, profile.step_model, num_prefill, num_decode, overheads,
                         concurrency).run(requests)
    return outcome(num_prefill, num_decode, records, slo_ttft_ms, slo_tpot_ms)


def outcome(num_prefill: int, num_decode: int, records: list[SimRecord], slo_ttft_ms: float,
            slo_tpot_ms: float) -> Outcome:
    ttft = [r.ttft_s * 1e3 for r in records]
    tpot = [r.tpot_s * 1e3 for r in records if r.tpot_s is not None]
    good = sum(r.ttft_s * 1e3 <= slo_ttft_ms and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)
               for r in records)
    duration = max(r.done_s for r in records) - min(r.request.arrival_s for r in records)
    return Outcome(num_prefill, num_decode, Percentiles.of(ttft), Percentiles.of(tpot) or Percentiles(0, 0, 0, 0),
                   good / len(records), good / max(duration, 1e-9), duration)


def search(profile: Profile, requests: list[SimRequest], slo_ttft_ms: float, slo_tpot_ms: float,
           max_replicas: int, attainment: float = 0.9) -> tuple[list[Outcome], Outcome | None]:
    """Every (P, D) with P + D <= max_replicas, best first; and the recommended one (None if none meets the SLOs)."""
    outcomes = [simulate(profile, requests, p, d, slo_ttft_ms, slo_tpot_ms)
                for p in range(0, max_replicas) for d in range(1, max_replicas - p + 1)]
    outcomes.sort(key=lambda o: (-o.goodput_per_replica, o.replicas, o.num_prefill))
    feasible = [o for o in outcomes if o.attainment >= attainment]
    return outcomes, feasible[0] if feasible else None


def plan_yaml(config_path: str | pathlib.Path, best: Outcome) -> str:
    """The input YAML with the recommended mode and replica counts (autoscaling of those roles replaced)."""
    data = yaml.safe_load(pathlib.Path(config_path).read_text()) or {}
    data["mode"] = "colocated" if best.num_prefill == 0 else "disaggregated"
    for role, count in (("prefill", best.num_prefill), ("decode", best.num_decode)):
        section = dict(data.get(role) or {})
        section.pop("autoscaling", None)
        section["replicas"] = max(1, count)  # colocated: the prefill role is not started
        data[role] = section
    header = (f"# raypd plan: {best.num_prefill} prefill + {best.num_decode} decode replicas "
              f"(expected TTFT p50 {best.ttft_ms.p50:.1f} ms, TPOT p50 {best.tpot_ms.p50:.2f} ms, "
              f"{best.attainment:.0%} within the SLOs)\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def format_outcomes(outcomes: list[Outcome], best: Outcome | None, limit: int = 12) -> str:
    lines = ["| prefill | decode | TTFT p50 / p90 ms | TPOT p50 / p90 ms | within SLOs | goodput req/s | per replica |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for o in outcomes[:limit]:
        mark = " **<- recommended**" if o is best else ""
        lines.append(f"| {o.num_prefill or 'colocated'} | {o.num_decode} | {o.ttft_ms.p50:.1f} / {o.ttft_ms.p90:.1f} "
                     f"| {o.tpot_ms.p50:.2f} / {o.tpot_ms.p90:.2f} | {o.attainment:.0%} | {o.goodput:.2f} | "
                     f"{o.goodput_per_replica:.2f}{mark} |")
    return "\n".join(lines)


def describe_profile(profile: Profile) -> str:
    terms = ", ".join(f"{name} {c * 1e6:.3g} us" for name, c in zip(FEATURES, profile.step_model.coefficients))
    lines = [f"profile of {profile.model}: {profile.num_steps} engine steps, {profile.threads or 'default'} torch "
             f"thread(s); step time = {terms} (per unit); median fit error {profile.fit_error:.1%}"]
    for mode, o in profile.overheads.items():
        lines.append(f"  serving path, {mode}: TTFT +{o.ttft_s * 1e3:.1f} ms + {o.ttft_per_request_s * 1e3:.1f} ms "
                     f"per request in flight; decode steps x{o.step_scale:.2f} + {o.seq_step_s * 1e3:.3f} ms per "
                     "sequence")
    if not profile.overheads:
        lines.append("  not calibrated against Serve (--calibrate): the engine alone is simulated")
    return "\n".join(lines)
