"""Recent latencies as one engine sees them, for autoscaling: time from accepting a request to its first response
(a prefill engine's share of TTFT) and the gap per token between its later responses (TPOT). Engine thread only."""

from __future__ import annotations

import time
from collections import deque

from llmapi.outputs import RequestDelta

WINDOW_S = 10.0  # samples older than this are forgotten: an idle engine reports no latency, not a stale one
_MAX_SAMPLES = 1024


class LatencyWindow:
    def __init__(self):
        self._accepted: dict[int, float] = {}  # request id -> when the engine took it
        self._last: dict[int, float] = {}  # request id -> when its latest response came out
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)  # (when, seconds)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)

    def accept(self, request_id: int) -> None:
        self._accepted[request_id] = time.monotonic()

    def observe(self, responses: list[RequestDelta]) -> None:
        now = time.monotonic()
        for rsp in responses:
            tokens = max((len(d.token_ids) for d in rsp.deltas), default=0)
            if rsp.request_id in self._accepted:
                self._ttft.append((now, now - self._accepted.pop(rsp.request_id)))
            elif rsp.request_id in self._last and tokens:
                self._tpot.append((now, (now - self._last[rsp.request_id]) / tokens))
            self._last[rsp.request_id] = now
            if rsp.finished:
                self._last.pop(rsp.request_id, None)

    def forget(self, request_id: int) -> None:
        """A request that ended without a response (aborted, failed)."""
        self._accepted.pop(request_id, None)
        self._last.pop(request_id, None)

    def means_ms(self) -> tuple[float, float]:
        """(TTFT, TPOT) means over the last WINDOW_S, in ms; 0 where there was no sample."""
        since = time.monotonic() - WINDOW_S
        return tuple(_mean([s for t, s in samples if t >= since]) * 1e3 for samples in (self._ttft, self._tpot))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
