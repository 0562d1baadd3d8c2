"""What a benchmark shows: a text table, a JSON record and latency CDF plots, each for one or several labelled results
(several: endpoints measured on the same workload, side by side)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Mapping

from benchmarks.client import METRICS, BenchResult

_TITLES = {"ttft": "TTFT (time to first token)", "tpot": "TPOT (time per output token)",
           "itl": "ITL (inter-token latency)", "e2e": "E2E (request latency)"}


def format_table(results: Mapping[str, BenchResult]) -> str:
    """One column per result: counts, throughput, goodput, then mean/p50/p90/p99 of each latency in ms."""
    rows = [("", *results)]
    rows += [(name, *(fmt(r) for r in results.values())) for name, fmt in _SUMMARY_ROWS]
    for metric in METRICS:
        for stat in ("mean", "p50", "p90", "p99"):
            cells = [r.latency_ms(metric) for r in results.values()]
            rows.append((f"{metric} {stat} (ms)", *("-" if p is None else f"{getattr(p, stat):.2f}" for p in cells)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]) for row in rows)
    return "\n".join(lines)


def _goodput(r: BenchResult) -> str:
    slos = [f"{name}<={v:g}ms" for name, v in (("ttft", r.config.slo_ttft_ms), ("tpot", r.config.slo_tpot_ms))
            if v is not None]
    return "-" if r.goodput is None else f"{r.goodput:.2f} ({r.good_requests} ok, {' '.join(slos)})"


_SUMMARY_ROWS = (
    ("requests ok / failed", lambda r: f"{r.completed} / {r.failed}"),
    ("duration (s)", lambda r: f"{r.duration_s:.2f}"),
    ("request throughput (req/s)", lambda r: f"{r.request_throughput:.2f}"),
    ("output throughput (tok/s)", lambda r: f"{r.output_throughput:.1f}"),
    ("goodput (req/s)", _goodput),
    ("prompt tokens cached", lambda r: "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"),
)


def to_json(results: Mapping[str, BenchResult]) -> dict[str, Any]:
    """A JSON-ready record per label: the config, the summary, the percentiles and every request's measurements."""
    return {label: _one(r) for label, r in results.items()}


def _one(r: BenchResult) -> dict[str, Any]:
    config = dataclasses.asdict(r.config)
    config.pop("api_key")  # a results file gets shared; the key must not travel with it
    config["request_rate"] = _finite(config["request_rate"])
    latency = {m: None if (p := r.latency_ms(m)) is None else dataclasses.asdict(p) for m in METRICS}
    requests = [{**dataclasses.asdict(rec), "tpot_s": rec.tpot_s} for rec in r.records]
    return {"config": config, "duration_s": r.duration_s, "completed": r.completed, "failed": r.failed,
            "output_tokens": r.output_tokens, "request_throughput": r.request_throughput,
            "output_throughput": r.output_throughput, "good_requests": r.good_requests, "goodput": r.goodput,
            "cache_hit_rate": r.cache_hit_rate,
            "latency_ms": latency, "requests": requests}


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"  # strict JSON has no Infinity


def write_json(results: Mapping[str, BenchResult], path: str | pathlib.Path) -> None:
    pathlib.Path(path).write_text(json.dumps(to_json(results), indent=2, allow_nan=False) + "\n")


def plot_latency_cdfs(results: Mapping[str, BenchResult], path: str | pathlib.Path) -> None:
    """A 2x2 PNG of empirical CDFs (TTFT, TPOT, ITL, E2E), one line per result, SLOs drawn as dashed lines."""
    # A bare Figure renders with Agg and touches no pyplot global state, so this works headless and in threads.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    for ax, metric in zip(fig.subplots(2, 2).flat, METRICS):
        for label, result in results.items():
            values = sorted(result.samples_ms(metric))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        for slo in {r.config.slo_ttft_ms if metric == "ttft" else r.config.slo_tpot_ms if metric == "tpot" else None
                    for r in results.values()} - {None}:
            ax.axvline(slo, linestyle="--", color="gray", label=f"SLO {slo:g} ms")
        ax.set(title=_TITLES[metric], xlabel="ms", ylabel="fraction of token gaps" if metric == "itl" else
               "fraction of requests", ylim=(0, 1.02))
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="lower right")
    fig.savefig(path, dpi=100)
