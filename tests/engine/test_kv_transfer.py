"""NixlTransport against real NIXL (UCX): a prefill-like peer in a second process, this process reads from it."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from engine.kv.kv_cache import KVCache, KVLayout
from engine.kv.kv_transfer import (
    GENERATIONS,
    BlockDescs,
    NixlTransport,
    PeerDisconnected,
    TransferError,
    TransferTimeout,
    TransportInfo,
)

NUM_BLOCKS = 12
IO_TIMEOUT_S = 20.0  # every pipe read and join is bounded: a broken peer fails the test, never hangs it


def layout(dtype: str = "float32") -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def filled_cache(dtype: str, seed: int) -> KVCache:
    """A cache whose every block holds distinct values derived from `seed`, so a misplaced block is noticed."""
    kv = KVCache(layout(dtype), NUM_BLOCKS)
    gen = torch.Generator().manual_seed(seed)
    # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv.arena.copy_(torch.randn(kv.arena.shape, generator=gen).to(kv.arena.dtype))
    return kv


def generations(seed: int) -> torch.Tensor:
    return torch.arange(NUM_BLOCKS, dtype=torch.int64) * 1000 + seed  # (num_blocks,)


def serve_blocks(conn, name: str, dtype: str, seed: int) -> None:
    """Peer process: exposes a filled arena and generation numbers, answers ("notifs", timeout_s) until "stop" or
    an idle parent."""
    with NixlTransport(name, filled_cache(dtype, seed), generations(seed)) as transport:
        conn.send(transport.metadata())
        while conn.poll(60):
            cmd = conn.recv()
            if cmd == "stop":
                return
            conn.send(wait_notifications(transport, cmd[1]))


def wait_notifications(transport: NixlTransport, timeout_s: float) -> dict[str, list[bytes]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = transport.poll_notifications()
        if got:
            return got
        time.sleep(0.005)
    return {}


def recv(conn, timeout_s: float = IO_TIMEOUT_S):
    assert conn.poll(timeout_s), f"peer process sent nothing within {timeout_s} s"
    return conn.recv()


class Peer:
    """A serve_blocks process and the pipe to it."""

    def __init__(self, name: str, dtype: str = "float32", seed: int = 1):
        self.name, self.dtype, self.seed = name, dtype, seed
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=serve_blocks, args=(child, name, dtype, seed), daemon=True)
        self.proc.start()
        self.metadata = recv(self.conn)

    def notifications(self, timeout_s: float) -> dict[str, list[bytes]]:
        self.conn.send(("notifs", timeout_s))
        return recv(self.conn, timeout_s + IO_TIMEOUT_S)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(IO_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(IO_TIMEOUT_S)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(*args, **kwargs) -> Peer:
        started.append(Peer(*args, **kwargs))
        return started[-1]

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="module")
def live_peer():
    peer = Peer("prefill-live")
    yield peer
    peer.stop()


def read(transport: NixlTransport, peer_name: str, remote, local, notif: bytes = b"", timeout_s: float = 10.0):
    handle = transport.start_read(peer_name, remote, local, notif)
    transport.wait(handle, time.monotonic() + timeout_s)
    assert handle.released
    return handle


def test_host_arena_starts_zeroed_and_its_views_outlive_the_cache():
    """The CPU arena is an anonymous mapping (huge pages where offered): zeroed, the layout's shape, and kept alive by
    any view of it after the KVCache itself is gone."""
    import gc

    kv = KVCache(layout("bfloat16"), NUM_BLOCKS)
    assert kv.arena.dtype == torch.bfloat16 and kv.arena.is_contiguous() and not kv.arena.any()
    assert kv.arena.shape[0] == NUM_BLOCKS and kv.block_ptr(1) - kv.block_ptr(0) == kv.layout.block_bytes
    keys, _ = kv.layer(0)
    del kv
    gc.collect()
    keys[1].fill_(2.0)
    assert float(keys.float().sum()) == 2.0 * keys[1].numel()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_copies_exactly_the_named_blocks_and_notifies_the_peer(peers, dtype):
    peer = peers("prefill-0", dtype=dtype, seed=1)
    expected = filled_cache(dtype, seed=1).arena
    local = filled_cache(dtype, seed=2)
    before = local.arena.clone()
    with NixlTransport("decode-0", local, torch.zeros(NUM_BLOCKS, dtype=torch.int64)) as transport:
        transport.connect(peer.name, peer.metadata)
        transport.connect(peer.name, peer.metadata)  # idempotent
        read(transport, peer.name, [5, 2, 9], [0, 7, 3], notif=b"req-17:done")
        for dst, src in [(0, 5), (7, 2), (3, 9)]:
            assert torch.equal(local.arena[dst], expected[src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 7, 3)]
        assert torch.equal(local.arena[untouched], before[untouched])
        assert peer.notifications(timeout_s=5) == {"decode-0": [b"req-17:done"]}
        # then the generation numbers, into the scratch at the same local ids (how a reader validates its read)
        handle = transport.start_read(peer.name, [5, 2, 9], [0, 7, 3], b"req-17:release", region=GENERATIONS)
        transport.wait(handle, time.monotonic() + 10)
        assert transport.generation_scratch[[0, 7, 3]].tolist() == generations(1)[[5, 2, 9]].tolist()
        assert transport.generation_scratch[untouched].eq(0).all()
        assert torch.equal(local.arena[untouched], before[untouched])
        assert peer.notifications(timeout_s=5) == {"decode-0": [b"req-17:release"]}


def test_block_descs_from_the_peer_are_accepted_and_checked(live_peer):
    info = TransportInfo.from_bytes(live_peer.metadata)
    descs = BlockDescs(info.agent_name, info.base_addr, info.block_bytes, (4, 1))
    local = KVCache(layout(), NUM_BLOCKS)
    with NixlTransport("decode-descs", local) as transport:
        transport.connect(live_peer.name, live_peer.metadata)
        read(transport, live_peer.name, descs, [6, 8])
        assert torch.equal(local.arena[[6, 8]], filled_cache("float32", seed=1).arena[[4, 1]])
        stale = BlockDescs(info.agent_name, info.base_addr + 4096, info.block_bytes, (4,))
        with pytest.raises(TransferError, match="stale or foreign"):
            transport.start_read(live_peer.name, stale, [0], b"")


def test_killed_peer_raises_peer_disconnected_and_a_restarted_peer_works(peers):
    local = KVCache(layout(), NUM_BLOCKS)
    with NixlTransport("decode-1", local) as transport:
        doomed = peers("prefill-1", seed=3)
        transport.connect(doomed.name, doomed.metadata)
        doomed.kill()
        t0 = time.monotonic()
        with pytest.raises(PeerDisconnected, match="prefill-1"):
            read(transport, doomed.name, [1], [1], timeout_s=5.0)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(PeerDisconnected, match="prefill-1"):  # later reads name the lost peer too
            transport.start_read(doomed.name, [1], [1], b"")
        restarted = peers("prefill-1", seed=4)  # same name, new process and arena
        transport.connect(restarted.name, restarted.metadata)
        read(transport, restarted.name, [2], [1], notif=b"again")
        assert torch.equal(local.arena[1], filled_cache("float32", seed=4).arena[2])
        assert restarted.notifications(timeout_s=5) == {"decode-1": [b"again"]}


def test_past_deadline_raises_timeout_and_releases_the_handle(live_peer):
    with NixlTransport("decode-2", KVCache(layout(), NUM_BLOCKS)) as transport:
        transport.connect(live_peer.name, live_peer.metadata)
        handle = transport.start_read(live_peer.name, [0, 1], [0, 1], b"late")
        with pytest.raises(TransferTimeout, match="prefill-live"):
            transport.wait(handle, deadline=time.monotonic() - 1.0)
        assert handle.released
        with pytest.raises(TransferError):
            transport.poll(handle)
        read(transport, live_peer.name, [3], [3])  # the transport is still usable
    live_peer.notifications(timeout_s=0.5)  # drain, so the next test sees only its own


@pytest.mark.parametrize(
    "remote, local, message",
    [
        ([NUM_BLOCKS], [0], "peer 'prefill-live' block ids out of range"),
        ([-1], [0], "out of range"),
        ([0], [NUM_BLOCKS + 3], "our .* block ids out of range"),
        ([0, 1], [2], "2 remote blocks but 1 local"),
        ([0, 1], [2, 2], "local block ids repeat"),
        ([], [], "no block ids"),
    ],
)
def test_bad_block_ids_are_refused_before_any_transfer(live_peer, remote, local, message):
    with NixlTransport("decode-3", KVCache(layout(), NUM_BLOCKS)) as transport:
        transport.connect(live_peer.name, live_peer.metadata)
        with pytest.raises(ValueError, match=message):
            transport.start_read(live_peer.name, remote, local, b"must-not-arrive")
    assert live_peer.notifications(timeout_s=0.3) == {}


def test_unknown_peer_incompatible_layout_and_missing_region_are_refused():
    gens = torch.zeros(NUM_BLOCKS, dtype=torch.int64)
    with NixlTransport("decode-4", KVCache(layout(), NUM_BLOCKS), gens) as transport, \
            NixlTransport("prefill-bf16", KVCache(layout("bfloat16"), NUM_BLOCKS)) as other, \
            NixlTransport("prefill-plain", KVCache(layout(), NUM_BLOCKS)) as plain:
        with pytest.raises(TransferError, match="not connected to peer 'nobody'"):
            transport.start_read("nobody", [0], [0], b"")
        transport.connect(other.name, other.metadata())  # its blocks can still be read in spans
        with pytest.raises(ValueError, match="layouts differ"):
            transport.start_read(other.name, [0], [0], b"")
        with pytest.raises(ValueError, match="names agent 'prefill-bf16'"):
            transport.connect("someone-else", other.metadata())
        transport.connect(plain.name, plain.metadata())
        with pytest.raises(ValueError, match="no 'generations' region on the peer"):
            transport.start_read(plain.name, [0], [0], b"", region=GENERATIONS)
        plain.connect(transport.name, transport.metadata())
        with pytest.raises(ValueError, match="no 'generations' region on our side"):
            plain.start_read(transport.name, [0], [0], b"", region=GENERATIONS)


def test_transport_info_round_trips_and_rejects_garbage():
    info = TransportInfo("prefill-9", b"\x00md\xff" * 10, 0x7F00_0000_1000, 1024, 64, "VRAM", 3, 0x5500_0000_0040)
    assert TransportInfo.from_bytes(info.to_bytes()) == info
    for bad in [b"", b"junk" * 20, info.to_bytes()[:-1], info.to_bytes() + b"x"]:
        with pytest.raises(ValueError):
            TransportInfo.from_bytes(bad)


def test_describe_blocks_gives_addresses_and_lengths():
    kv = KVCache(layout(), NUM_BLOCKS)
    with NixlTransport("prefill-5", kv) as transport:
        descs = transport.describe_blocks([3, 0])
        assert descs.spans() == [(kv.block_ptr(3), kv.layout.block_bytes), (kv.block_ptr(0), kv.layout.block_bytes)]
        with pytest.raises(ValueError, match="out of range"):
            transport.describe_blocks([NUM_BLOCKS])
