"""A role's `nice` (cluster.config.Role): its replica processes run that many nice levels below the others, as under
`nice -n`. On a host the roles share, `decode.nice` lets the work a first token waits on (the ingress, the prefill
engine) run ahead of decode steps; the decode engine takes the cores in between (docs/performance.md measures it).

Raising one's own nice needs no privilege, so it works wherever the replica runs; it only matters where processes
compete for cores. The deployment passes the increment in the replica's environment (NICE_ENV); the replica applies
it as it starts, before it starts its own threads.
"""

from __future__ import annotations

import os

NICE_ENV = "RAYPD_NICE"
MAX_NICE = 19  # Linux's lowest priority


def nice_env(increment: int) -> dict[str, str]:
    """The replica environment that asks for `increment` (nothing for 0)."""
    return {NICE_ENV: str(increment)} if increment else {}


def apply_nice() -> int | None:
    """Adds the increment NICE_ENV names to every thread of this process (Linux keeps a nice per thread; threads
    started later inherit their starter's), at most MAX_NICE; the process's nice afterwards, or None when none was
    asked for."""
    increment = int(os.environ.get(NICE_ENV) or 0)
    if not increment:
        return None
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no per-thread view (not Linux): the process's nice
        return os.nice(min(increment, MAX_NICE - os.nice(0)))
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)
