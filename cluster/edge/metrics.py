"""Request metrics of one ingress replica, in Prometheus text at /metrics, mirrored to ray.util.metrics so Ray's own
Prometheus export carries them cluster-wide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray.util import metrics as ray_metrics

from llmapi.result import GenerationResult

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TIMINGS = {"ttft": "time to first token", "tpot": "time per output token after the first",
            "e2e": "arrival to last token", "request_queue_time": "arrival to first schedule on the prefill engine"}


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._hist = {k: Histogram(f"raypd_{k}_seconds", doc, registry=self.registry, buckets=_LATENCY_BUCKETS)
                      for k, doc in _TIMINGS.items()}
        self._ray_hist = {k: ray_metrics.Histogram(f"raypd_{k}_seconds", doc, boundaries=list(_LATENCY_BUCKETS))
                          for k, doc in _TIMINGS.items()}
        self._finished = Counter("raypd_requests", "finished requests (per choice) by finish reason",
                                 ["finish_reason"], registry=self.registry)
        self._ray_finished = ray_metrics.Counter("raypd_requests_total", "finished requests by finish reason",
                                                 tag_keys=("finish_reason",))
        self._kv = Gauge("raypd_kv", "KV state of one replica per role, sampled at scrape time",
                         ["role", "what"], registry=self.registry)

    def observe(self, result: GenerationResult) -> None:
        for index, stats in result.metrics.items():
            for key, hist in self._hist.items():
                if key in stats:
                    hist.observe(stats[key])
                    self._ray_hist[key].observe(stats[key])
        for out in result.outputs:
            reason = out.finish_reason or "unknown"
            self._finished.labels(reason).inc()
            self._ray_finished.inc(tags={"finish_reason": reason})

    def set_kv(self, role: str, stats: dict[str, float]) -> None:
        for what, value in stats.items():
            self._kv.labels(role, what).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
