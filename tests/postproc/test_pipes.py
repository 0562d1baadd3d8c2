"""Token pipes over real ZeroMQ on 127.0.0.1: round trips, signature checks before unpickling, deadlines."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from postproc.pipes import (
    PullPipe,
    PushPipe,
    PushPipes,
    is_loopback,
    new_pipe_key,
    sign,
    tcp_address,
)


@dataclass(frozen=True)
class TokenBatch:
    step: int
    token_ids: tuple[int, ...]
    blob: bytes = b""


def _touch(path: str) -> None:
    Path(path).touch()


class Tripwire:
    """Unpickling this creates a file: the visible side effect that proves whether a payload was deserialized."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (_touch, (self.path,))


@pytest.fixture
def key() -> bytes:
    return new_pipe_key()


@pytest.fixture
def pull(key):
    with PullPipe((tcp_address("127.0.0.1"), key)) as pipe:
        yield pipe


@pytest.fixture
def raw_push(pull):
    """A bare zmq PUSH socket: lets a test put arbitrary frames on the wire, as an attacker could."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pull.addr[0])
    yield sock
    sock.close()


def test_bind_to_port_zero_publishes_real_port(pull, key):
    assert not pull.addr[0].endswith(":0")
    assert pull.addr[1] == key


def test_round_trip_dataclass_and_order(pull):
    with PushPipe(pull.addr) as push:
        push.put(TokenBatch(0, (1, 2, 3)))
        assert pull.get(timeout=5) == TokenBatch(0, (1, 2, 3))
        for i in range(1000):
            push.put(TokenBatch(i, (i,)))
        assert [pull.get(timeout=5).step for _ in range(1000)] == list(range(1000))
    assert pull.dropped == 0


def _push_from_child(addr, n: int) -> None:
    with PushPipe(addr) as push:
        for i in range(n):
            push.put(TokenBatch(i, (i, i + 1)))


def test_round_trip_across_processes(pull):
    child = multiprocessing.get_context("spawn").Process(target=_push_from_child, args=(pull.addr, 500))
    child.start()
    try:
        first = pull.get(timeout=60)  # a spawned interpreter takes a while to start
        rest = [pull.get(timeout=10) for _ in range(499)]
    finally:
        child.join(timeout=30)
    assert [b.step for b in [first, *rest]] == list(range(500))
    assert rest[-1] == TokenBatch(499, (499, 500))
    assert child.exitcode == 0


def _bad_messages(key: bytes, trip: bytes) -> dict[str, list[bytes]]:
    benign = pickle.dumps("benign")
    return {
        "tampered": [sign(key, benign), trip],  # valid mac, payload swapped after signing
        "flipped_byte": [sign(key, trip), trip[:-2] + bytes([trip[-2] ^ 1]) + trip[-1:]],
        "foreign_key": [sign(new_pipe_key(), trip), trip],
        "unsigned": [b"", trip],
        "truncated_mac": [sign(key, trip)[:16], trip],
        "one_frame": [trip],
        "three_frames": [sign(key, trip), trip, b"extra"],
    }


@pytest.mark.parametrize(
    "case", ["tampered", "flipped_byte", "foreign_key", "unsigned", "truncated_mac", "one_frame", "three_frames"]
)
def test_unverified_message_dropped_without_unpickling(case, pull, raw_push, key, tmp_path):
    marker = tmp_path / "unpickled"
    raw_push.send_multipart(_bad_messages(key, pickle.dumps(Tripwire(marker)))[case])
    after = pickle.dumps(TokenBatch(7, (7,)))
    raw_push.send_multipart([sign(key, after), after])  # same connection, so it queues behind the bad one
    assert pull.get(timeout=5) == TokenBatch(7, (7,))
    assert pull.dropped == 1
    assert not marker.exists()


def test_tripwire_fires_when_validly_signed(pull, tmp_path):
    # The control for the test above: the same payload, validly signed, does run code when unpickled.
    marker = tmp_path / "unpickled"
    with PushPipe(pull.addr) as push:
        push.put(Tripwire(marker))
        pull.get(timeout=5)
    assert marker.exists()


def test_all_bad_messages_counted_then_valid_arrives(pull, raw_push, key, tmp_path):
    marker = tmp_path / "unpickled"
    bad = _bad_messages(key, pickle.dumps(Tripwire(marker)))
    for frames in bad.values():
        raw_push.send_multipart(frames)
    after = pickle.dumps("after")
    raw_push.send_multipart([sign(key, after), after])
    assert pull.get(timeout=5) == "after"
    assert pull.dropped == len(bad)
    assert not marker.exists()


def test_get_times_out(pull):
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        pull.get(timeout=0.2)
    assert 0.19 <= time.monotonic() - start < 1.0
    assert not pull.poll(timeout=0.05)


def test_drops_do_not_extend_the_deadline(pull, raw_push):
    for _ in range(3):
        raw_push.send_multipart([b"junk", b"junk"])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="3 dropped"):
        pull.get(timeout=0.2)
    assert 0.19 <= time.monotonic() - start < 1.0


def test_unsigned_refused_off_loopback():
    for address in ("tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:5555", "tcp://eth0:5555"):
        with pytest.raises(ValueError, match="loopback"):
            PullPipe((address, None))
        with pytest.raises(ValueError, match="loopback"):
            PushPipe((address, None))
    with pytest.raises(ValueError, match="length"):
        PullPipe((tcp_address("127.0.0.1"), b"short"))


def test_is_loopback():
    for address in ("tcp://127.0.0.1:1", "tcp://127.3.4.5:1", "tcp://localhost:1", "tcp://[::1]:1", "ipc:///tmp/x",
                    "inproc://x"):
        assert is_loopback(address), address
    for address in ("tcp://0.0.0.0:1", "tcp://[::]:1", "tcp://192.168.1.1:1", "tcp://127.0.0.1:1;10.0.0.1:2"):
        assert not is_loopback(address), address


def test_unsigned_loopback_pipe(tmp_path):
    with PullPipe((tcp_address("127.0.0.1"), None)) as pull, PushPipe(pull.addr) as push:
        push.put(TokenBatch(1, (1,)))
        assert pull.get(timeout=5) == TokenBatch(1, (1,))
        # A key mismatch between the ends shows up as drops: the unsigned end refuses signed messages.
        with PushPipe((pull.addr[0], new_pipe_key())) as signed_push:
            signed_push.put(Tripwire(tmp_path / "unpickled"))
            with pytest.raises(TimeoutError):
                pull.get(timeout=0.3)
        assert pull.dropped == 1
        assert not (tmp_path / "unpickled").exists()


def test_push_with_no_peer_times_out(key):
    with PushPipe((tcp_address("127.0.0.1"), key), bind=True) as push:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            push.put("nobody listens", timeout=0.2)
        assert time.monotonic() - start < 1.0


def test_async_round_trip_and_timeout(pull, raw_push, key):
    async def main():
        with PushPipe(pull.addr) as push:
            for i in range(100):
                await push.aput(TokenBatch(i, (i,)))
            got = [(await pull.aget(timeout=5)).step for _ in range(100)]
        raw_push.send_multipart([b"junk", b"junk"])
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await pull.aget(timeout=0.2)
        return got, time.monotonic() - start

    got, waited = asyncio.run(main())
    assert got == list(range(100))
    assert 0.19 <= waited < 1.0
    assert pull.dropped == 1
    # The same pipe still serves a second event loop, and blocking callers, afterwards.
    with PushPipe(pull.addr) as push:
        push.put("second loop")
        assert asyncio.run(pull.aget(timeout=5)) == "second loop"
        push.put("blocking")
        assert pull.get(timeout=5) == "blocking"


def test_drops_warn_once_per_hundred(pull, raw_push, caplog):
    for _ in range(150):
        raw_push.send_multipart([b"junk"])
    with caplog.at_level("WARNING", logger="postproc.pipes"), pytest.raises(TimeoutError):
        pull.get(timeout=0.5)
    assert pull.dropped == 150
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 2


def test_close_is_idempotent(key):
    pipe = PullPipe((tcp_address("127.0.0.1"), key))
    pipe.close()
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.get(timeout=0.1)


def _send_many(addr, n: int, batch: TokenBatch) -> None:
    with PushPipe(addr) as push:
        for _ in range(n):
            push.put(batch)


def test_throughput_1kb(pull):
    n = 20_000
    batch = TokenBatch(0, tuple(range(64)), blob=b"x" * 800)
    size = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    sender = threading.Thread(target=_send_many, args=(pull.addr, n, batch))
    start = time.monotonic()
    sender.start()
    for _ in range(n):
        pull.get(timeout=10)
    elapsed = time.monotonic() - start
    sender.join(timeout=10)
    rate = n / elapsed
    mb_s = rate * size / 1e6
    print(f"\npipe throughput: {rate:,.0f} msg/s, {mb_s:.1f} MB/s ({size} B payloads, signed, tcp loopback)")
    assert rate > 5_000


def test_ipv6_loopback(key):
    try:
        pull = PullPipe((tcp_address("::1"), None))
    except zmq.ZMQError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with pull, PushPipe(pull.addr) as push:
        assert pull.addr[0].startswith("tcp://[::1]:")
        push.put(TokenBatch(6, (6,)))
        assert pull.get(timeout=5) == TokenBatch(6, (6,))


def test_push_pipes_reuse_a_peers_pipe_and_close_the_least_recently_used_past_the_limit():
    pulls = [PullPipe((tcp_address("127.0.0.1"), new_pipe_key())) for _ in range(3)]
    pipes = PushPipes(limit=2)
    try:
        first = pipes.get(pulls[0].addr)
        assert pipes.get(pulls[0].addr) is first
        second = pipes.get(pulls[1].addr)
        pipes.get(pulls[0].addr)  # used again: pulls[1]'s pipe is now the least recently used
        pipes.get(pulls[2].addr)
        with pytest.raises(RuntimeError, match="closed"):
            second.put("x")
        first.put("still open", timeout=5)
        assert pulls[0].get(timeout=5) == "still open"
        pipes.drop(pulls[0].addr)
        with pytest.raises(RuntimeError, match="closed"):
            first.put("x")
        assert pipes.get(pulls[0].addr) is not first
    finally:
        pipes.close()
        for p in pulls:
            p.close()
