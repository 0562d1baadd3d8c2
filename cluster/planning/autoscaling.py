"""SLO-driven autoscaling: a Serve custom autoscaling policy that scales each role on what it is responsible for.

Every prefill and decode replica reports (EngineWorker.record_autoscaling_stats): queued_prompt_tokens and ttft_ms
(accept to first token on that replica), running_seqs, kv_usage (fraction of its KV pool held) and tpot_ms. A role's
YAML names per-replica targets for some of them (`autoscaling.slo`, cluster/config.py: prefill weighs queued prompt
tokens and TTFT, decode running sequences, KV use and TPOT). Serve's controller calls the policy each control-loop
tick with the metrics averaged over `look_back_period_s`; it returns the replica count that brings the worst
metric to its target: current * max(mean / target). Serve then applies min/max_replicas, the up/downscale delays
and factors.

Serve pickles this module by value into its controller: it must import nothing outside the standard library.
"""

from __future__ import annotations

import math

PREFILL_SIGNALS = ("queued_prompt_tokens", "ttft_ms")
DECODE_SIGNALS = ("running_seqs", "kv_usage", "tpot_ms")


def desired_replicas(current: int, metrics: dict[str, dict], targets: dict[str, float]) -> tuple[float, dict]:
    """(replicas wanted, each weighed signal's mean / target). metrics: name -> {replica: value}, as Serve's
    AutoscalingContext.aggregated_metrics. A signal no replica has reported yet is not weighed; with none at all
    the count stays."""
    ratios = {}
    for name, target in targets.items():
        values = [float(v) for v in (metrics.get(name) or {}).values() if v is not None and math.isfinite(v)]
        if values:
            ratios[name] = sum(values) / len(values) / target
    if not ratios or current == 0:
        return float(current), ratios
    return current * max(ratios.values()), ratios


class RolePolicy:
    """Serve instantiates it once per deployment with policy_kwargs, then calls it each tick."""

    def __init__(self, targets: dict[str, float]):
        self.targets = {name: float(value) for name, value in targets.items()}

    def __call__(self, ctx) -> tuple[float, dict]:
        current = ctx.current_num_replicas
        if current == 0:  # cold start: Serve's own path brings the first replica up
            return ctx.target_num_replicas, {}
        want, ratios = desired_replicas(current, ctx.aggregated_metrics or {}, self.targets)
        return want, {"raypd_ratios": ratios}
