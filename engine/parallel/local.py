"""Ranks 1..N-1 of an engine as child processes on this host (the embedded LLM's tensor parallelism)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import Connection

import torch

from engine.parallel.shm import ShmAllReduce
from engine.parallel.ranks import START_TIMEOUT_S, RankGroup, RankSetup, master_store, rank_device

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # where `engine` imports from


class LocalRanks:
    """The child processes behind ranks 1..N-1 (Members)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def exited(self) -> dict[int, str]:
        return {rank: _how(p.returncode) for rank, p in self.procs.items() if p.poll() is not None}

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_local_ranks(model_dir: str, size: int, dtype: str | None, device: str, num_threads: int | None,
                      block_size: int, kv_transfer: bool = False) -> RankGroup:
    """Starts ranks 1..size-1 and joins the group with them; this process is rank 0. Each rank runs num_threads
    torch threads, or an equal share of this host's cores (this process's count is set to match). kv_transfer:
    each rank exposes its KV pool on a NIXL agent of its own."""
    threads = num_threads or max(1, (os.cpu_count() or 1) // size)
    torch.set_num_threads(threads)
    store, members, channels = master_store(size), LocalRanks(), []
    group_id = uuid.uuid4().hex
    shm_path = os.path.join(SHM_DIR, f"raypd-tp-{group_id}")
    ShmAllReduce.create(shm_path, size)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    try:
        for rank in range(1, size):
            mine, theirs = socket.socketpair()
            members.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.rank_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
            channels.append(Connection(mine.detach()))
            channels[-1].send(RankSetup(rank, size, "127.0.0.1", store.port, str(model_dir), dtype,
                                        rank_device(device, rank), threads, block_size, shm_path,
                                        f"raypd-{group_id[:12]}-r{rank}" if kv_transfer else None))
        group = RankGroup(channels, members, store)
        group.join(time.monotonic() + START_TIMEOUT_S, device, shm_path)
        return group
    except BaseException:
        for channel in channels:
            channel.close()
        members.stop(0.0)
        raise
    finally:
        os.unlink(shm_path)  # every rank has mapped it (or none ever will): the name goes, the mappings stay


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
