"""The tensor-parallel ranks of one engine. Rank 0 is the engine's own process: it schedules, samples and keeps the
block accounting; every step it sends its StepPlan to the other ranks, which only run their shard of the model on it
(their collectives meet rank 0's inside the forward). A plan travels over one channel per rank (a
multiprocessing Connection). The ranks rendezvous on a torch.distributed store and process group; the all-reduce is
that group's (NCCL on CUDA, gloo on CPU), or, for ranks on one host's CPUs, engine/parallel/shm.py's.

Who starts the other ranks (child processes for the embedded LLM, engine/parallel/local.py) only hands RankGroup
their channels and a way to tell which of them has exited.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from engine.parallel.shard import Shard
from engine.parallel.shm import ShmAllReduce

# A collective waits this long for the other ranks: well past the longest step (a long prefill chunk of a big model
# on a CPU), so it only ends a rank that hangs. A rank that dies ends it at once (its connections close; the
# shared-memory all-reduce looks for its process).
COLLECTIVE_TIMEOUT_S = 300.0
# Starting a rank: the interpreter, torch and the model shard.
START_TIMEOUT_S = 300.0
_POLL_S = 0.1


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 tells each other rank once: enough to join the group and build its shard."""

    rank: int
    size: int
    store_host: str
    store_port: int
    model_dir: str
    dtype: str | None
    device: str
    num_threads: int | None
    block_size: int
    shm_path: str | None = None  # ranks on one host's CPUs all-reduce through this file (engine/parallel/shm.py)
    kv_agent: str | None = None  # the name of this rank's NIXL agent over its KV pool; None: the engine moves no KV


@dataclass(frozen=True)
class RankReady:
    """A rank has its shard and KV pool. kv_transport: how peers reach that pool (TransportInfo bytes), if exposed."""

    kv_transport: bytes | None = None


class RankFailed(RuntimeError):
    """A tensor-parallel rank exited or stopped answering: the engine cannot run another step."""


class Members(Protocol):
    """The processes behind ranks 1..N-1, however they were started."""

    def exited(self) -> dict[int, str]:
        """rank -> how it ended, for the ranks that are gone. Mutates nothing."""

    def stop(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the ranks to end (they were told to), then kills what is left. Idempotent."""


def master_store(size: int, host: str = "127.0.0.1") -> dist.TCPStore:
    """The store the ranks rendezvous on, served by rank 0's process on a free port of this host (store.port), which
    the other ranks reach at host."""
    return dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


class AllReduce:
    """The sum over the ranks, in place: `reduce` sums a contiguous tensor in place (a process group's all-reduce, or
    ShmAllReduce). Counts the calls and the time spent in them (what tensor parallelism costs a step)."""

    def __init__(self, reduce: Callable[[torch.Tensor], None]):
        self.reduce = reduce
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        x = x.contiguous()
        self.reduce(x)
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return x


def join_group(rank: int, size: int, store: dist.Store, device: str = "cpu", shm_path: str | None = None) -> Shard:
    """This rank's Shard over the group's process group (through shared memory where shm_path is given for a CPU
    engine). Blocks until every rank joined."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if shm_path is not None and torch.device(device).type == "cpu":
        reduce = ShmAllReduce(shm_path, rank, size, COLLECTIVE_TIMEOUT_S)
        dist.ProcessGroupGloo(store, rank, size, timeout)  # the rendezvous: every rank has mapped the file after it
        return Shard(rank, size, AllReduce(reduce))
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return Shard(rank, size, AllReduce(lambda x: group.allreduce([x]).wait()))


def rank_device(device: str, rank: int) -> str:
    """The device of a rank: rank r of a CUDA engine on "cuda" or "cuda:i" takes the r-th GPU from there."""
    dev = torch.device(device)
    return f"cuda:{(dev.index or 0) + rank}" if dev.type == "cuda" else device


class RankGroup:
    """Rank 0's view of the others: their channels (index r - 1 is rank r's, each already sent its RankSetup) and
    processes. join() makes rank 0's shard."""

    def __init__(self, channels: list, members: Members, store: dist.TCPStore):
        self.size = len(channels) + 1
        self.shard: Shard | None = None
        self._channels = channels
        self._members = members
        self._store = store  # the master of the rendezvous: it must outlive the group
        self._closed = False
        self.kv_transports: tuple[bytes, ...] = ()  # ranks 1..N-1's, when their pools are exposed (RankReady)

    def join(self, deadline: float, device: str = "cpu", shm_path: str | None = None) -> Shard:
        """Waits (until deadline, time.monotonic()) for every rank to start, then joins the group with them."""
        for rank, channel in enumerate(self._channels, 1):
            self.receive(rank, channel, deadline, "start")
        self.shard = join_group(0, self.size, self._store, rank_device(device, 0), shm_path)
        return self.shard

    def start(self, num_blocks: int, deadline: float) -> None:
        """Tells every rank its KV pool size and waits (until deadline, time.monotonic()) for each to be ready."""
        for channel in self._channels:
            channel.send(num_blocks)
        ready = [self.receive(rank, channel, deadline, "build its model shard")
                 for rank, channel in enumerate(self._channels, 1)]
        self.kv_transports = tuple(r.kv_transport for r in ready if r.kv_transport is not None)

    def receive(self, rank: int, channel, deadline: float, doing: str):
        """The next message from rank; RankFailed if it exits or the deadline passes first."""
        while not channel.poll(_POLL_S):
            gone = self._members.exited()
            if rank in gone:
                raise RankFailed(f"tensor-parallel rank {rank} of {self.size} {gone[rank]} before it could {doing}")
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel rank {rank} of {self.size} did not {doing} in time")
        return channel.recv()

    def send(self, plan) -> None:
        """One step's plan to every other rank (they run it as soon as it arrives). Pickled once, by plain pickle:
        multiprocessing's own would hand tensors over as shared file descriptors, which only its children open."""
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for channel in self._channels:
            channel.send_bytes(data)

    def exited(self) -> dict[int, str]:
        """rank -> how it ended, for the other ranks that are gone."""
        return self._members.exited()

    def reports(self) -> list:
        """What the other ranks have said since the last call (engine/kv/head_reads.ReadDone), without waiting."""
        said = []
        with self.guard():
            for channel in self._channels:
                while channel.poll(0):
                    said.append(channel.recv())
        return said

    @contextlib.contextmanager
    def guard(self):
        """Turns a failed send or collective into RankFailed naming the rank that exited; an error of a step whose
        ranks are all alive passes unchanged."""
        try:
            yield
        except (RuntimeError, OSError, EOFError) as exc:
            gone = self._exited_soon()
            if not gone:
                raise
            named = "; ".join(f"rank {r} {how}" for r, how in sorted(gone.items()))
            raise RankFailed(f"a tensor-parallel rank of this engine ({self.size} ranks) is gone: {named}") from exc

    def _exited_soon(self, wait_s: float = 2.0) -> dict[int, str]:
        """The ranks that exited, giving a dying one a moment: its collective may fail before its process ends."""
        deadline = time.monotonic() + wait_s
        while not (gone := self._members.exited()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return gone

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells every rank to stop and waits for them (then kills). Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop = pickle.dumps(None)
        for channel in self._channels:
            with contextlib.suppress(OSError, ValueError):
                channel.send_bytes(stop)
        self._members.stop(timeout_s)
        for channel in self._channels:
            channel.close()
