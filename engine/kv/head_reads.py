"""Reading a prompt's KV across tensor-parallel splits (prefill TP2 -> decode TP1, TP1 -> TP2, ...).

Every rank of an engine has a pool of its own KV heads, with the same block ids on every rank (the scheduler on rank
0 allocates for all). A reading rank takes each of its heads from the first rank of the other side that holds it:
when that rank holds exactly this rank's heads, whole blocks (one span each); otherwise the heads' slice of every
(layer, key/value, position) row of each block, written into the same rows of ours (TensorRT-LLM's KV transceiver
splits and concatenates heads the same way, without a staging copy here). A rank reads only the heads it holds.

Rank 0's connector turns an import into a ReadOrder that every rank of the reading engine runs on its own NIXL agent
(RankImport); ranks 1..N-1 report a ReadDone when theirs ends (RankReader, run by engine/parallel/rank_main.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.kv_cache import KVLayout
from engine.kv.kv_transfer import BlockSpans, NixlTransport, ReadHandle, TransferError, TransportInfo


@dataclass(frozen=True)
class HeadRead:
    """Heads [start, stop) of the model, read from one rank of the other side."""

    remote_rank: int
    heads: tuple[int, int]
    whole: bool  # that rank holds exactly this rank's heads: its blocks are ours, read whole


def head_reads(local: KVLayout, rank: int, remote: KVLayout) -> list[HeadRead]:
    """What rank `rank` of `local` reads from the ranks of `remote`, in head order; a head several remote ranks
    hold (more ranks than heads) is read from the first of them."""
    start, stop = local.rank_heads(rank)
    holders = [remote.rank_heads(r) for r in range(remote.tp_size)]
    reads, head = [], start
    while head < stop:
        holder = next(r for r, (s, e) in enumerate(holders) if s <= head < e)
        end = min(stop, holders[holder][1])
        reads.append(HeadRead(holder, (head, end), (head, end) == holders[holder] == (start, stop)))
        head = end
    return reads


def head_spans(read: HeadRead, local: KVLayout, rank: int, remote: KVLayout) -> tuple[np.ndarray, np.ndarray]:
    """(remote spans, local spans), each (block_layers * planes * block_size, 2) of (offset in a block, length): the
    read's heads in every row of a block, a row being one (layer, key/value, position) of (heads, head_dim)."""
    head_bytes = local.head_dim * torch.empty((), dtype=local.torch_dtype).element_size()
    rows = np.arange(local.block_layers * local.planes * local.block_size, dtype=np.uint64)
    first, last = read.heads
    length = np.full_like(rows, (last - first) * head_bytes)

    def spans(layout: KVLayout, holder: int) -> np.ndarray:
        skip = (first - layout.rank_heads(holder)[0]) * head_bytes
        return np.stack([rows * np.uint64(layout.num_kv_heads * head_bytes) + np.uint64(skip), length], axis=1)

    return spans(remote, read.remote_rank), spans(local, rank)


@dataclass(frozen=True)
class ReadOrder:
    """One import, as each rank of the reading engine runs it for its own heads."""

    key: int
    layout: KVLayout  # the prefill side's
    transports: tuple[bytes, ...]  # TransportInfo of each rank of the prefill side, rank 0 first
    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]


@dataclass(frozen=True)
class CancelRead:
    key: int


@dataclass(frozen=True)
class ReadDone:
    """A rank's part of an import ended: error None means its heads are in place."""

    key: int
    rank: int
    error: str | None
    bytes_read: int


class RankImport:
    """One order's reads on one rank: a read from each rank of the other side that holds some of this rank's heads.
    Starting them raises TransferError or ValueError (nothing is left in flight then)."""

    def __init__(self, transport: NixlTransport, layout: KVLayout, rank: int, order: ReadOrder):
        self._transport = transport
        self.handles: list[ReadHandle] = []
        self.bytes_read = 0
        try:
            for read in head_reads(layout, rank, order.layout):
                self._start(read, layout, rank, order)
        except BaseException:
            self.cancel()
            raise

    def _start(self, read: HeadRead, layout: KVLayout, rank: int, order: ReadOrder) -> None:
        if read.remote_rank >= len(order.transports):
            raise ValueError(f"the KV handle names {len(order.transports)} prefill ranks, its layout "
                             f"{order.layout.tp_size}")
        info = order.transports[read.remote_rank]
        name = TransportInfo.from_bytes(info).agent_name
        self._transport.connect(name, info)
        count = len(order.local_blocks)
        if read.whole:
            self.handles.append(self._transport.start_read(name, order.remote_blocks, order.local_blocks, b""))
            self.bytes_read += count * layout.block_bytes
            return
        remote, local = head_spans(read, layout, rank, order.layout)
        spans = BlockSpans(order.remote_blocks, order.local_blocks, remote, local)
        self.handles.append(self._transport.start_read_spans(name, spans))
        self.bytes_read += count * int(local[:, 1].sum())

    def poll(self) -> bool:
        """True once every read has completed; raises TransferError if one failed."""
        return all([self._transport.poll(h) for h in self.handles])

    def cancel(self) -> None:
        for handle in self.handles:
            self._transport.cancel(handle)


class RankReader:
    """Ranks 1..N-1 of a reading engine: runs rank 0's orders on this rank's agent and says when each ends."""

    def __init__(self, transport: NixlTransport, layout: KVLayout, rank: int):
        self.transport = transport
        self._layout = layout
        self._rank = rank
        self._imports: dict[int, RankImport] = {}
        self._pause = 50e-6

    @property
    def busy(self) -> bool:
        return bool(self._imports)

    def handle(self, message: ReadOrder | CancelRead) -> list[ReadDone]:
        if isinstance(message, CancelRead):
            imp = self._imports.pop(message.key, None)
            if imp is not None:
                imp.cancel()
            return []
        try:
            self._imports[message.key] = RankImport(self.transport, self._layout, self._rank, message)
        except (TransferError, ValueError) as e:
            return [ReadDone(message.key, self._rank, str(e), 0)]
        self._pause = 50e-6
        return self.poll()

    def poll(self) -> list[ReadDone]:
        done = []
        for key, imp in list(self._imports.items()):
            try:
                if not imp.poll():
                    continue
                done.append(ReadDone(key, self._rank, None, imp.bytes_read))
            except TransferError as e:
                done.append(ReadDone(key, self._rank, str(e), 0))
            del self._imports[key]
        return done

    def wait_s(self) -> float:
        """How long to wait for rank 0 before polling the reads again: backing off, so a read that takes a while
        does not spin this rank's core."""
        pause, self._pause = self._pause, min(self._pause * 2, 2e-3)
        return pause

    def close(self) -> None:
        for imp in self._imports.values():
            imp.cancel()
        self._imports.clear()
        self.transport.close()
