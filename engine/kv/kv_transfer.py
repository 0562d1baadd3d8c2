"""The KV plane: READ a peer's KV blocks into ours, and tell the peer when they have arrived.

The engine talks to `KVTransport`; `NixlTransport` implements it over NIXL with the UCX backend. Each side registers
its whole block arena once. One block is one contiguous span (see kv_cache.py), so a read is one descriptor per block,
picked by index from descriptor lists prepared once per arena, never built per transfer.

The decode side reads (pull), and the notification that rides on the read tells the prefill side it may free the
blocks. Every wait takes a deadline; a dead peer surfaces as `PeerDisconnected`, never as a hang.

Besides the blocks, a transport may expose the block manager's generation numbers (one int64 per block) as a second
region, "generations": a reader fetches them into its `generation_scratch` after the data, and a number that changed
since the handle was made means the block was reused while being read (DESIGN.md, Rules).
"""

from __future__ import annotations

import logging
import operator
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import nixl  # noqa: F401  (importing the package is what makes nixl._bindings resolve to the installed wheel)
import numpy as np
import torch
from nixl import _bindings as nixl_bind

from engine.kv.kv_cache import KVCache

log = logging.getLogger(__name__)

# The progress thread polls UCX's event fd; this is only its timeout. The Python wrapper hard-codes 0, which turns
# the thread into a busy loop (~2/3 of a core per idle agent), so we build the agent from the bindings ourselves.
# 5 ms rather than 1: with a prefill and a decode engine on one small host, the shorter wake-ups cost decode ~10% TPOT
# and bought no transfer time (reads finish in the reader's post call; the fd wakes the thread when needed).
PROGRESS_POLL_US = 5000

_NIXL_ERRORS = tuple(
    getattr(nixl_bind, n) for n in dir(nixl_bind) if n.startswith("nixl") and n.endswith("Error")
)
BLOCKS, GENERATIONS = "blocks", "generations"  # the regions a transport can expose
_GENERATION_BYTES = 8  # int64, as BlockManager.generations
_MEM_CODES = {"DRAM": 0, "VRAM": 1}
_MEM_SEGS = {"DRAM": nixl_bind.DRAM_SEG, "VRAM": nixl_bind.VRAM_SEG}


class TransferError(RuntimeError):
    """A KV transfer failed; the message names the peer and what happened."""


class TransferTimeout(TransferError):
    """A read did not complete before its deadline; its handle has been released."""


class PeerDisconnected(TransferError):
    """The peer is gone (process died, or NIXL reports its connection lost); reconnect with fresh metadata."""


@dataclass(frozen=True)
class TransportInfo:
    """What a peer needs to read our blocks: NIXL agent metadata plus where and how big our arena is."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str = "DRAM"  # "DRAM" | "VRAM"
    device_id: int = 0
    generations_addr: int = 0  # address of num_blocks int64 generation numbers in DRAM; 0: none exposed

    # magic, version, mem type, device id, base address, block bytes, num blocks, generations address,
    # name length, metadata length
    _HEADER = struct.Struct("!4sBBHQQQQII")
    _MAGIC = b"RPKV"

    def __post_init__(self):
        if not self.agent_name:
            raise ValueError("TransportInfo.agent_name must not be empty")
        if self.mem_type not in _MEM_CODES:
            raise ValueError(f"TransportInfo.mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        if self.block_bytes < 1 or self.num_blocks < 1:
            raise ValueError(f"TransportInfo of {self.agent_name!r}: block_bytes and num_blocks must be >= 1")

    def to_bytes(self) -> bytes:
        name = self.agent_name.encode()
        header = self._HEADER.pack(self._MAGIC, 1, _MEM_CODES[self.mem_type], self.device_id, self.base_addr,
                                   self.block_bytes, self.num_blocks, self.generations_addr, len(name),
                                   len(self.agent_metadata))
        return header + name + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> TransportInfo:
        """Parses what to_bytes made; raises ValueError on anything else (no pickle: peers are not trusted blindly)."""
        data = bytes(data)
        if len(data) < cls._HEADER.size:
            raise ValueError("transport info is truncated")
        magic, version, mem, dev, base, block_bytes, num_blocks, gens, n_name, n_md = cls._HEADER.unpack_from(data)
        if magic != cls._MAGIC or version != 1:
            raise ValueError("transport info has an unknown format (magic/version mismatch)")
        if len(data) != cls._HEADER.size + n_name + n_md or mem not in _MEM_CODES.values():
            raise ValueError("transport info is malformed (lengths or memory type)")
        name = data[cls._HEADER.size:cls._HEADER.size + n_name].decode()
        mem_type = next(k for k, v in _MEM_CODES.items() if v == mem)
        return cls(name, data[cls._HEADER.size + n_name:], base, block_bytes, num_blocks, mem_type, dev, gens)

    def regions(self) -> dict[str, _Region]:
        """What a peer may read from this agent, by region name."""
        found = {BLOCKS: _Region(self.mem_type, self.device_id, self.base_addr, self.block_bytes, self.num_blocks)}
        if self.generations_addr:
            found[GENERATIONS] = _Region("DRAM", 0, self.generations_addr, _GENERATION_BYTES, self.num_blocks)
        return found


@dataclass(frozen=True)
class _Region:
    """A registered array of equal entries (KV blocks, generation numbers), one NIXL descriptor per entry."""

    mem_type: str
    device_id: int
    base_addr: int
    entry_bytes: int
    count: int

    @classmethod
    def of(cls, tensor: torch.Tensor, count: int) -> _Region:
        mem_type, device_id = ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)
        return cls(mem_type, device_id, tensor.data_ptr(), tensor.nbytes // count, count)

    def reg_dlist(self):
        """The whole region as one registration (one memory registration, however many entries)."""
        span = (self.base_addr, self.entry_bytes * self.count, self.device_id, "")
        return nixl_bind.nixlRegDList(_MEM_SEGS[self.mem_type], [span])

    def xfer_dlist(self):
        rows = block_dlist(self.base_addr, self.entry_bytes, self.count, self.device_id)
        return nixl_bind.nixlXferDList(_MEM_SEGS[self.mem_type], rows)


@dataclass(frozen=True)
class BlockDescs:
    """Blocks of one agent's arena: block i is the span (base_addr + i * block_bytes, block_bytes)."""

    agent_name: str
    base_addr: int
    block_bytes: int
    block_ids: tuple[int, ...]

    def spans(self) -> list[tuple[int, int]]:
        """(address, length) per block, in block_ids order."""
        return [(self.base_addr + i * self.block_bytes, self.block_bytes) for i in self.block_ids]


@dataclass(frozen=True)
class BlockSpans:
    """The same parts of several blocks: local[i] and remote[i] are (offset in a block, length) pairs of equal
    lengths, read for each pair of (remote_blocks[j], local_blocks[j])."""

    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    remote: np.ndarray  # (S, 2) uint64
    local: np.ndarray  # (S, 2) uint64

    def __post_init__(self):
        if self.remote.shape != self.local.shape or self.remote.ndim != 2 or self.remote.shape[1] != 2:
            raise ValueError(f"span tables must both be (S, 2), got {self.remote.shape} and {self.local.shape}")
        if not np.array_equal(self.remote[:, 1], self.local[:, 1]):
            raise ValueError("each remote span must be as long as its local one")

    @staticmethod
    def rows(base_addr: int, block_bytes: int, block_ids: tuple[int, ...], spans: np.ndarray,
             device_id: int) -> np.ndarray:
        """(len(block_ids) * S, 3) NIXL rows (address, length, device): every span of every block, block-major."""
        if spans.size and int((spans[:, 0] + spans[:, 1]).max()) > block_bytes:
            raise ValueError(f"a span reaches past the end of a {block_bytes}-byte block")
        starts = np.uint64(base_addr) + np.asarray(block_ids, dtype=np.uint64)[:, None] * np.uint64(block_bytes)
        rows = np.empty((len(block_ids), len(spans), 3), dtype=np.uint64)
        rows[:, :, 0] = starts + spans[None, :, 0]
        rows[:, :, 1] = spans[None, :, 1]
        rows[:, :, 2] = device_id
        return rows.reshape(-1, 3)


@dataclass(eq=False)
class ReadHandle:
    """One read in flight. Opaque to callers except for `released` and `peer_name`."""

    peer_name: str
    xfer: int  # NIXL request handle
    num_blocks: int
    done: bool = False
    released: bool = False
    error: TransferError | None = field(default=None, repr=False)  # why it ended, if not by completing


class KVTransport(ABC):
    """Moves KV blocks between engines' arenas. The decode side reads; the prefill side frees on notifications."""

    name: str  # agent name, unique per engine
    generation_scratch: torch.Tensor | None  # (num_blocks,) int64: where region="generations" reads land; None: none

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to connect() to reach us. Mutates nothing."""

    @abstractmethod
    def describe_blocks(self, block_ids: Sequence[int]) -> BlockDescs:
        """Addresses and lengths of some of our blocks, for a peer to read. Mutates nothing; validates the ids."""

    @abstractmethod
    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Loads the peer's metadata and prepares its block list. Idempotent; new metadata for a known name replaces
        the old connection (a restarted peer). Mutates the peer table."""

    @abstractmethod
    def disconnect(self, peer_name: str) -> None:
        """Cancels reads from the peer and forgets it. Idempotent. Mutates the peer table."""

    @abstractmethod
    def start_read(self, peer_name: str, remote_blocks: BlockDescs | Sequence[int], local_block_ids: Sequence[int],
                   notif: bytes, region: str = BLOCKS) -> ReadHandle:
        """Starts reading the peer's blocks into our blocks (pairwise, in order); on completion the peer receives
        `notif` (b"" sends none). With region="generations" it reads the blocks' generation numbers into our
        `generation_scratch` at the local ids instead. Refuses bad ids or regions (ValueError) before anything moves.
        Mutates our local blocks (or scratch), asynchronously."""

    @abstractmethod
    def poll(self, handle: ReadHandle) -> bool:
        """True once the read has completed (the handle is then released). Raises PeerDisconnected/TransferError
        if it failed (the handle is then released too). Mutates the handle."""

    @abstractmethod
    def cancel(self, handle: ReadHandle) -> None:
        """Releases the handle, aborting the read if it is still running. Idempotent. Mutates the handle."""

    @abstractmethod
    def poll_notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, peer name -> messages. Consumes them."""

    @abstractmethod
    def send_notification(self, peer_name: str, message: bytes) -> None:
        """Sends a message to a connected peer without moving data (a release when nothing had to be read).
        Raises PeerDisconnected/TransferError. Mutates nothing here."""

    @abstractmethod
    def close(self) -> None:
        """Cancels reads, forgets peers, unregisters the arena. Idempotent."""

    def wait(self, handle: ReadHandle, deadline: float) -> None:
        """Blocks until the read completes, by `deadline` (time.monotonic()). A completion is only accepted if seen
        before the deadline: a late read may have raced with the peer freeing its blocks. Always releases the handle.
        Raises TransferTimeout, PeerDisconnected or TransferError."""
        pause = 50e-6
        try:
            while True:
                late = time.monotonic() - deadline
                if late >= 0:
                    # Even if the data has landed meanwhile, a late read does not count: say so to later polls too.
                    handle.error = TransferTimeout(f"read of {handle.num_blocks} block(s) from peer "
                                                   f"{handle.peer_name!r} missed its deadline by {late * 1e3:.1f} ms; "
                                                   "it was cancelled")
                    handle.done = False
                    raise handle.error
                if self.poll(handle):
                    return
                # back off: on a small host a spinning waiter steals the core the transfer needs
                time.sleep(min(pause, -late))
                pause = min(pause * 2, 2e-3)
        finally:
            self.cancel(handle)

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_nixl_agent(name: str):
    """A NIXL agent (raw bindings) with the UCX backend, configured for small hosts as well as big ones."""
    cfg = nixl_bind.nixlAgentConfig()
    # A READ needs the *target* to make progress too (UCX wire-up, TCP emulated RMA), even while its engine is busy.
    cfg.useProgThread = True
    cfg.pthrDelay = PROGRESS_POLL_US
    cfg.useListenThread = False  # metadata travels over our own control plane
    cfg.lthrDelay = 100_000
    # The agent locks itself, so e.g. poll_notifications may run on another thread than the reads (our own peer and
    # handle tables still expect one thread).
    cfg.syncMode = nixl_bind.NIXL_THREAD_SYNC_STRICT
    cfg.captureTelemetry = False
    agent = nixl_bind.nixlAgent(name, cfg)
    if "UCX" not in agent.getAvailPlugins():
        raise TransferError(f"NIXL agent {name!r}: the UCX plugin is not available")
    # One worker, no thread pool (num_threads=0): extra threads only pay off with many cores and huge descriptor lists.
    # Peer error handling is what turns a dead peer into an error instead of a hang.
    agent.createBackend("UCX", {"num_workers": "1", "ucx_error_handling_mode": "peer"})
    return agent


def block_dlist(base_addr: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """(num_blocks, 3) rows of (address, length, device id), one per block: NIXL's Nx3 descriptor form."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows


@dataclass
class _Peer:
    info: TransportInfo
    dlists: dict[str, int]  # region -> prepared descriptor list of all its entries on the peer


class NixlTransport(KVTransport):
    """KVTransport over one NIXL agent (UCX backend) that has a whole arena of equal entries registered (a KVCache's
    blocks, or any contiguous tensor whose first dimension indexes entries: the encoder's embedding slots), and, when
    given, one int64 generation number per entry ((num_entries,), CPU) for peers to validate their reads."""

    def __init__(self, name: str, arena: KVCache | torch.Tensor, generations: torch.Tensor | None = None):
        tensor = arena.arena if isinstance(arena, KVCache) else arena
        _check_memory(tensor, generations)
        self.name = name
        self._num_blocks = tensor.shape[0]
        self._block_bytes = tensor.nbytes // self._num_blocks
        # (num_blocks,) where reads of a peer's generation numbers land
        self.generation_scratch = None if generations is None else torch.zeros_like(generations)
        self._peers: dict[str, _Peer] = {}
        self._lost: dict[str, str] = {}  # peer name -> why it was dropped
        self._inflight: set[ReadHandle] = set()
        self._closed = False
        self._agent = make_nixl_agent(name)
        exposed = self._register(tensor, generations)
        self._local = {BLOCKS: self._prep("", exposed[BLOCKS])}
        if generations is not None:
            self._local[GENERATIONS] = self._prep("", _Region.of(self.generation_scratch, self._num_blocks))
        blocks = exposed[BLOCKS]
        self._info = TransportInfo(name, self._agent.getLocalMD(), blocks.base_addr, self._block_bytes,
                                   self._num_blocks, blocks.mem_type, blocks.device_id,
                                   exposed[GENERATIONS].base_addr if generations is not None else 0)
        self._memory = (tensor, generations)  # registered memory must outlive the agent's use of it

    def _register(self, arena: torch.Tensor, generations: torch.Tensor | None) -> dict[str, _Region]:
        """Registers the arena (and generations + scratch); must precede getLocalMD, which describes them."""
        exposed = {BLOCKS: _Region.of(arena, self._num_blocks)}
        tensors = [arena]
        if generations is not None:
            exposed[GENERATIONS] = _Region.of(generations, self._num_blocks)
            tensors += [generations, self.generation_scratch]
        self._regs = [_Region.of(t, self._num_blocks).reg_dlist() for t in tensors]
        for reg in self._regs:
            self._agent.registerMem(reg, [])
        return exposed

    def _prep(self, agent_name: str, region: _Region) -> int:
        return self._agent.prepXferDlist(agent_name or nixl_bind.NIXL_INIT_AGENT, region.xfer_dlist(), [])

    def metadata(self) -> bytes:
        return self._info.to_bytes()

    def describe_blocks(self, block_ids: Sequence[int]) -> BlockDescs:
        ids = _checked_ids(block_ids, self._num_blocks, f"our ({self.name!r}) block")
        return BlockDescs(self.name, self._info.base_addr, self._block_bytes, ids)

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        self._check_open()
        info = TransportInfo.from_bytes(peer_metadata)
        if info.agent_name != peer_name:
            raise ValueError(f"metadata for peer {peer_name!r} names agent {info.agent_name!r}")
        known = self._peers.get(peer_name)
        if known is not None and known.info == info:
            return
        self.disconnect(peer_name)
        self._peers[peer_name] = self._load_peer(info)
        self._lost.pop(peer_name, None)

    def _load_peer(self, info: TransportInfo) -> _Peer:
        name = info.agent_name
        try:
            self._agent.loadRemoteMD(info.agent_metadata)
            dlists = {region: self._prep(name, r) for region, r in info.regions().items()}
            self._agent.makeConnection(name, [])  # wire up now, so the first read does not pay for it
        except _NIXL_ERRORS as e:
            self._forget_remote(name)
            raise _translate(e, name, "connect to it") from e
        return _Peer(info, dlists)

    def disconnect(self, peer_name: str) -> None:
        self._drop(peer_name, TransferError(f"read from peer {peer_name!r} cancelled: we disconnected from it"))

    def _drop(self, peer_name: str, why: TransferError) -> None:
        for handle in [h for h in self._inflight if h.peer_name == peer_name]:
            handle.error = handle.error or why
            self.cancel(handle)
        peer = self._peers.pop(peer_name, None)
        if peer is not None:
            for dlist in peer.dlists.values():
                _quietly(self._agent.releasedDlistH, dlist)
            self._forget_remote(peer_name)

    def _forget_remote(self, peer_name: str) -> None:
        _quietly(self._agent.invalidateRemoteMD, peer_name)

    def start_read(self, peer_name: str, remote_blocks: BlockDescs | Sequence[int], local_block_ids: Sequence[int],
                   notif: bytes, region: str = BLOCKS) -> ReadHandle:
        self._check_open()
        peer = self._peer(peer_name)
        if region not in self._local or region not in peer.dlists:
            side = "our side" if region not in self._local else "the peer"
            raise ValueError(f"read from peer {peer_name!r}: no {region!r} region on {side}")
        if region == BLOCKS and peer.info.block_bytes != self._block_bytes:
            raise ValueError(f"read from peer {peer_name!r}: its blocks are {peer.info.block_bytes} bytes, ours "
                             f"{self._block_bytes}: the KV layouts differ (read head slices with start_read_spans)")
        remote = _remote_ids(peer.info, remote_blocks)
        local = _checked_ids(local_block_ids, self._num_blocks, f"our ({self.name!r}) block")
        if len(local) != len(remote):
            raise ValueError(f"read from peer {peer_name!r}: {len(remote)} remote blocks but {len(local)} local ones")
        if len(set(local)) != len(local):
            raise ValueError(f"read from peer {peer_name!r}: local block ids repeat: {list(local)}")
        return self._start(peer_name, len(local), lambda: self._agent.makeXferReq(
            nixl_bind.NIXL_READ, self._local[region], list(local), peer.dlists[region], list(remote), bytes(notif),
            [], False))

    def start_read_spans(self, peer_name: str, spans: BlockSpans, notif: bytes = b"") -> ReadHandle:
        """Starts reading parts of the peer's blocks into parts of ours: spans.remote[i] (offset in its block,
        length) of peer block remote_blocks[j] into spans.local[i] of our block local_blocks[j], for every i and j
        (a tensor-parallel rank's KV heads out of another split's blocks). Refuses spans outside a block
        (ValueError). Mutates our local blocks, asynchronously."""
        self._check_open()
        info = self._peer(peer_name).info
        remote = _remote_ids(info, spans.remote_blocks)
        local = _checked_ids(spans.local_blocks, self._num_blocks, f"our ({self.name!r}) block")
        if len(local) != len(remote) or len(set(local)) != len(local):
            raise ValueError(f"read from peer {peer_name!r}: {len(remote)} remote and {len(local)} local blocks, "
                             "pairwise and without repeats")
        remote_rows = spans.rows(info.base_addr, info.block_bytes, remote, spans.remote, info.device_id)
        local_rows = spans.rows(self._info.base_addr, self._block_bytes, local, spans.local, self._info.device_id)
        remote_list = nixl_bind.nixlXferDList(_MEM_SEGS[info.mem_type], remote_rows)
        local_list = nixl_bind.nixlXferDList(_MEM_SEGS[self._info.mem_type], local_rows)
        return self._start(peer_name, len(local), lambda: self._agent.createXferReq(
            nixl_bind.NIXL_READ, local_list, remote_list, peer_name, bytes(notif), []))

    def _start(self, peer_name: str, num_blocks: int, make) -> ReadHandle:
        try:
            xfer = make()
        except _NIXL_ERRORS as e:
            raise self._failed(peer_name, e, "prepare a read") from e
        handle = ReadHandle(peer_name, xfer, num_blocks)
        self._inflight.add(handle)
        self._post(handle)
        return handle

    def _post(self, handle: ReadHandle) -> None:
        self._settle(handle, self._status(handle, self._agent.postXferReq, "post a read"))

    def _status(self, handle: ReadHandle, call, doing: str):
        """call(xfer) -> NIXL status; a NIXL error fails the handle (released) and is raised as a TransferError."""
        try:
            return call(handle.xfer)
        except _NIXL_ERRORS as e:
            handle.error = self._failed(handle.peer_name, e, doing)
            self.cancel(handle)
            raise handle.error from e

    def poll(self, handle: ReadHandle) -> bool:
        if handle.done:
            return True
        if handle.released:
            raise handle.error or TransferError(f"read from peer {handle.peer_name!r}: handle already released")
        self._settle(handle, self._status(handle, self._agent.getXferStatus, "complete a read"))
        return handle.done

    def _settle(self, handle: ReadHandle, status) -> None:
        """Acts on a NIXL status: done -> release; error -> release, drop the peer, raise."""
        if status == nixl_bind.NIXL_IN_PROG:
            return
        if status == nixl_bind.NIXL_SUCCESS:
            handle.done = True
            self.cancel(handle)
            return
        # UCX runs with peer error handling: a failed request means the endpoint to the peer broke.
        handle.error = PeerDisconnected(f"read from peer {handle.peer_name!r} failed with NIXL status {status}; "
                                        "the peer is considered gone")
        self._lose(handle.peer_name, str(handle.error))
        self.cancel(handle)
        raise handle.error

    def cancel(self, handle: ReadHandle) -> None:
        if handle.released:
            return
        handle.released = True
        self._inflight.discard(handle)
        if not handle.done and handle.error is None:
            handle.error = TransferError(f"read from peer {handle.peer_name!r} was cancelled")
        try:
            self._agent.releaseXferReq(handle.xfer)
        except _NIXL_ERRORS as e:
            # NIXL keeps a request it cannot abort; its local blocks may still be written, so say so loudly.
            log.error("NIXL could not release a read from peer %r (%s): its local blocks may still be written",
                      handle.peer_name, e)

    def poll_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        try:
            return dict(self._agent.getNotifs({}, []))
        except _NIXL_ERRORS as e:
            raise TransferError(f"agent {self.name!r}: reading notifications failed: {e!r}") from e

    def send_notification(self, peer_name: str, message: bytes) -> None:
        self._check_open()
        self._peer(peer_name)
        try:
            self._agent.genNotif(peer_name, bytes(message), [])
        except _NIXL_ERRORS as e:
            raise self._failed(peer_name, e, "send a notification") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._inflight):
            handle.error = handle.error or TransferError(f"read from {handle.peer_name!r} cancelled: transport closed")
            self.cancel(handle)
        for name in list(self._peers):
            self._drop(name, TransferError(f"read from peer {name!r} cancelled: transport closed"))
        for dlist in self._local.values():
            _quietly(self._agent.releasedDlistH, dlist)
        for reg in self._regs:
            _quietly(self._agent.deregisterMem, reg, [])
        del self._agent  # the agent's destructor stops its progress thread and tells peers we left

    def _peer(self, peer_name: str) -> _Peer:
        peer = self._peers.get(peer_name)
        if peer is not None:
            return peer
        if peer_name in self._lost:
            raise PeerDisconnected(f"peer {peer_name!r} is gone ({self._lost[peer_name]}); reconnect with fresh "
                                   "metadata")
        raise TransferError(f"not connected to peer {peer_name!r}: call connect() with its metadata first")

    def _failed(self, peer_name: str, error: Exception, doing: str) -> TransferError:
        translated = _translate(error, peer_name, doing)
        if isinstance(translated, PeerDisconnected):
            self._lose(peer_name, str(translated))
        return translated

    def _lose(self, peer_name: str, why: str) -> None:
        """Drops a dead peer so a restarted one can connect under the same name; later reads say why."""
        self._drop(peer_name, PeerDisconnected(f"read from peer {peer_name!r} cancelled: {why}"))
        self._lost[peer_name] = why

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.name!r} is closed")


def _check_memory(arena: torch.Tensor, generations: torch.Tensor | None) -> None:
    if not arena.is_contiguous() or arena.dim() < 1 or arena.shape[0] < 1:
        raise ValueError("NixlTransport needs a contiguous arena of at least one entry: entries are addressed as "
                         "base + id * entry_bytes")
    n = arena.shape[0]
    if generations is not None and (generations.shape != (n,) or generations.dtype != torch.int64
                                    or generations.is_cuda or not generations.is_contiguous()):
        raise ValueError(f"generations must be a contiguous CPU int64 tensor of shape ({n},), got "
                         f"{generations.dtype} {tuple(generations.shape)} on {generations.device}")


def _translate(error: Exception, peer_name: str, doing: str) -> TransferError:
    if isinstance(error, nixl_bind.nixlRemoteDisconnectError):
        return PeerDisconnected(f"peer {peer_name!r} disconnected: could not {doing}")
    return TransferError(f"could not {doing} with peer {peer_name!r}: NIXL raised {error!r}")


def _checked_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> tuple[int, ...]:
    ids = tuple(operator.index(i) for i in block_ids)
    if not ids:
        raise ValueError(f"no block ids given for {what}s")
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{what} ids out of range [0, {num_blocks}): {bad}")
    return ids


def _remote_ids(info: TransportInfo, blocks: BlockDescs | Sequence[int]) -> tuple[int, ...]:
    what = f"peer {info.agent_name!r} block"
    if not isinstance(blocks, BlockDescs):
        return _checked_ids(blocks, info.num_blocks, what)
    if (blocks.agent_name, blocks.base_addr, blocks.block_bytes) != (info.agent_name, info.base_addr,
                                                                   info.block_bytes):
        # The descriptors come from another arena: a stale handle from before the peer restarted, or a mix-up.
        raise TransferError(f"block descriptors of {blocks.agent_name!r} do not match the arena of connected peer "
                            f"{info.agent_name!r}: stale or foreign handle")
    return _checked_ids(blocks.block_ids, info.num_blocks, what)


def _quietly(fn, *args) -> None:
    """Teardown steps: an error (peer already gone, already released) must not stop the rest of the teardown."""
    try:
        fn(*args)
    except _NIXL_ERRORS as e:
        log.debug("ignored during teardown: %s%r: %r", fn.__name__, args[:1], e)
