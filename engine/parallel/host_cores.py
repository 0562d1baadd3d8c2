"""Engines on one host lend each other idle cores for their prompt-heavy steps.

Engines that share a host each run `num_threads` torch threads (configs/local.yaml: one each, since prefill and
decode share a 2-core machine and two threads each would fight over both cores). Then a prompt prefilled while the
other engine has nothing to compute runs at half the machine's speed: a 345-token prefill of the tiny model takes
13.8 ms on one thread and 8.6-9.7 ms on two (bf16, Zen 4), where vLLM's single engine uses every core it binds.

Each engine publishes, in a table in shared memory (one slot per engine, under /dev/shm), how many threads it is
computing with and until when it counts as busy. Before a forward of at least `min_tokens` tokens (a prompt chunk,
not a decode step: a batch of single tokens gains little from a second thread and loses more to waiting for it),
an engine takes the cores no other engine claims, never fewer than its own threads, and gives them back after the
forward. An engine that finished a forward less than `grace_s` ago still counts as busy, so a decoding engine
between two steps is never taken for idle. A slot is claimed with an advisory lock, which the kernel drops when its
process dies; a dead engine's claim lapses by its time.

Processes that are not engines (the HTTP ingress, postproc workers, clients) do not publish: under load the
engines' own steps keep each other from borrowing, and a borrowed core costs at most one step.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pathlib
import tempfile
import time
from typing import Iterator

import numpy as np
import torch

_SLOTS = 64
_SLOT_BYTES = 16  # threads (float64), busy until (float64, time.monotonic(): one clock for every process on a host)
_IN_FORWARD_S = 5.0  # how long a claim made for a forward lasts if its process dies in it
# Slots this process's engines hold: a POSIX lock never conflicts with its own process, so engines in one process
# (tests, an embedded LLM beside others) tell each other apart here. The table is opened once per process and never
# closed (closing any descriptor of a file drops all of the process's locks on it); a freed slot's lock stays with the
# process until it exits, and its engines reuse it.
_HELD: set[int] = set()
_TABLES: dict[pathlib.Path, tuple[int, mmap.mmap]] = {}


def _open(path: pathlib.Path) -> tuple[int, mmap.mmap]:
    if path not in _TABLES:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < _SLOTS * _SLOT_BYTES:
            os.ftruncate(fd, _SLOTS * _SLOT_BYTES)
        _TABLES[path] = (fd, mmap.mmap(fd, _SLOTS * _SLOT_BYTES))
    return _TABLES[path]


def table_path() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path(tempfile.gettempdir())
    return base / f"raypd-host-cores-{os.getuid()}"


class HostCores:
    """One engine's slot in the host's table. base: the engine's own threads; cores: what this process may run on."""

    def __init__(self, base: int, min_tokens: int = 128, grace_s: float = 0.05, path: pathlib.Path | None = None,
                 cores: int | None = None):
        self.base = base
        self.cores = cores or len(os.sched_getaffinity(0))
        self.min_tokens = min_tokens
        self.grace_s = grace_s
        self.path = path or table_path()
        self._fd, table = _open(self.path)
        self._table = np.frombuffer(table, dtype=np.float64).reshape(_SLOTS, 2)
        self.slot = self._claim()
        self._closed = False
        self._table[self.slot] = (0.0, 0.0)
        self.borrowed_steps = 0

    def _claim(self) -> int:
        for slot in range(_SLOTS):
            if slot in _HELD:
                continue
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT_BYTES, slot * _SLOT_BYTES)
                _HELD.add(slot)
                return slot
            except OSError:
                continue
        raise RuntimeError(f"all {_SLOTS} slots of {self.path} are held: more engines on this host than it tracks")

    def others(self) -> float:
        """Threads the host's other engines are computing with (or paused between steps with)."""
        now = time.monotonic()
        busy = self._table[:, 1] > now
        busy[self.slot] = False
        return float(self._table[busy, 0].sum())

    def threads_for(self, num_tokens: int) -> int:
        if num_tokens < self.min_tokens:
            return self.base
        return max(self.base, min(self.cores, self.cores - int(self.others())))

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[int]:
        """Claims threads for a forward of num_tokens (yields how many), and keeps the base claim for grace_s after."""
        threads = self.threads_for(num_tokens)
        self._table[self.slot] = (threads, time.monotonic() + _IN_FORWARD_S)
        if threads != self.base:
            torch.set_num_threads(threads)
            self.borrowed_steps += 1
        try:
            yield threads
        finally:
            if threads != self.base:
                torch.set_num_threads(self.base)
            self._table[self.slot] = (self.base, time.monotonic() + self.grace_s)

    def close(self) -> None:
        """Gives the slot back to this process's engines (other processes get it when this one exits)."""
        if not self._closed:
            self._closed = True
            self._table[self.slot] = (0.0, 0.0)
            _HELD.discard(self.slot)


class FixedThreads:
    """No sharing: every forward runs on the engine's own threads."""

    borrowed_steps = 0

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[None]:
        yield None

    def close(self) -> None:
        pass
