"""CLI servers in tests: waiting until one is healthy, and finding what it left running (every process whose
working directory is the one it ran in); processes by program or title, and their threads' nice; the process an
actor runs in."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import httpx


def actor_pid(actor, timeout_s: float = 30.0) -> int:
    """The pid of the process a Ray actor runs in (raises while it is restarting or dead)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=timeout_s)


def processes_in(directory: pathlib.Path) -> list[int]:
    """Processes whose working directory is `directory` (a CLI run there, and every Ray process it started)."""
    return _processes_where(lambda proc: pathlib.Path(os.readlink(proc / "cwd")) == directory)


def processes_running(program: str) -> list[int]:
    """Processes whose executable is named `program` (e.g. haproxy)."""
    return _processes_where(lambda proc: pathlib.Path(os.readlink(proc / "exe")).name == program)


def processes_titled(text: str) -> list[int]:
    """Processes whose command line contains `text` (Ray titles a worker by what it runs: ray::ServeReplica:APP:ROLE,
    ray::RankActor...)."""
    return _processes_where(lambda proc: text.encode() in (proc / "cmdline").read_bytes())


def thread_nices(pid: int) -> set[int]:
    """The nice values of a process's threads (Linux keeps one per thread)."""
    nices = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            nices.add(os.getpriority(os.PRIO_PROCESS, int(task.name)))
        except ProcessLookupError:
            pass
    return nices


def _processes_where(test) -> list[int]:
    """Processes whose /proc/PID directory passes `test`; those gone or not ours to read are skipped."""
    pids = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if test(proc):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(base: str, proc: subprocess.Popen, log_path: pathlib.Path, timeout_s: float,
                 ready_line: str = "") -> None:
    """Until `base`/health answers 200 and the log has ready_line (the command is done deploying); fails with the
    log's tail if the command exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not (ready_line in log_path.read_text(errors="replace") and healthy(base)):
        assert proc.poll() is None, f"{proc.args[0]} exited: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not healthy in time: {log_path.read_text()[-3000:]}"
        time.sleep(0.25)
