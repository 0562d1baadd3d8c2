"""Token pipes: per-step batches between engines, postproc workers and frontends, over ZeroMQ PUSH/PULL.

A pipe address is `(address, hmac_key)`, e.g. `("tcp://10.0.0.7:5555", key)`. Which side binds is a parameter: a
postproc worker binds its pull pipe and engines connect to it; each frontend binds its lane and workers connect a push
pipe to it. Bind to port 0 (`tcp_address(host)`) and publish `pipe.addr`, which holds the port the OS chose.

Wire format: a two-frame message `[mac, payload]`, payload = pickle of our own dataclasses. The pull side checks
`mac == sign(pipe_key, payload)` with `hmac.compare_digest` before it unpickles anything, because unpickling
runs code: a message with the wrong frame count or a bad, foreign or missing mac is dropped unread and counted in
`PullPipe.dropped`. Keys are per pipe (`new_pipe_key()`). `sign` is HMAC-SHA256 under a key derived from the pipe
key (HMAC(pipe_key, "raypd.pipe.v1")), so a pipe MAC can never pass as another signature made with the same key (e.g.
`opaque_state`, if a cluster key were reused here).

Unsigned pipes (key None) are for loopback only (tcp to 127.0.0.0/8, localhost or [::1]; ipc://; inproc://): the
constructor refuses anything else. An unsigned pipe sends `[b"", payload]`. The ends must agree: a signed pull pipe
drops an empty mac like any bad one, and an unsigned pull pipe drops a non-empty mac, so a key mismatch between the
two ends shows up as drops, never as data trusted without a check. Unsigned means trusting every process on the host.

Not covered: replay of a captured valid message into the same pipe (no sequence numbers). A pipe belongs to one thread
or one event loop; `get`/`aget` and `put`/`aput` may be mixed there, not used concurrently.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import os
import pickle
import time
from collections import OrderedDict
from typing import Any

import zmq
import zmq.asyncio

from protocol import PipeAddr

logger = logging.getLogger(__name__)


MIN_KEY_BYTES = 16
_HWM = 100_000  # messages; a token batch per engine step, so this is minutes of backlog, not an unbounded queue
_LINGER_MS = 1_000  # pending messages get this long to flush at close, then are discarded: close never hangs
_MAX_MSG_BYTES = 64 << 20  # an unauthenticated peer could otherwise make us buffer an arbitrarily large frame
_HEARTBEAT_IVL_MS = 5_000  # notices a peer on a dead node so a connecting side reconnects instead of waiting on it
_HEARTBEAT_TIMEOUT_MS = 15_000
_WARN_EVERY = 100  # one warning per this many drops: a flood of junk must not become a flood of logs
_MAC_CONTEXT = b"raypd.pipe.v1"
_NOTHING = object()  # _recv_valid found no valid message (empty socket, or the message was dropped)


def new_pipe_key() -> bytes:
    """A fresh random HMAC key for one pipe."""
    return os.urandom(32)


def tcp_address(host: str, port: int = 0) -> str:
    """`tcp://host:port`, bracketing IPv6 hosts. Port 0 makes a binding pipe take a free port (see `pipe.addr`)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def is_loopback(address: str) -> bool:
    """True if the address cannot leave this host, the only case where an unsigned pipe is allowed."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or ";" in rest:  # "src;dst" connect syntax: refuse rather than guess which host counts
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or "*": may well be reachable from other hosts
        return False


def sign(key: bytes, payload: bytes) -> bytes:
    """The mac a pipe with `key` puts in front of `payload`."""
    return hmac.digest(_mac_key(key), payload, "sha256")


def _mac_key(key: bytes) -> bytes:
    return hmac.digest(key, _MAC_CONTEXT, "sha256")


def _check_addr(addr: PipeAddr) -> None:
    address, key = addr
    if key is None:
        if not is_loopback(address):
            raise ValueError(
                f"pipe {address!r} has no HMAC key: unsigned pipes are allowed only on loopback "
                "(127.x.x.x, localhost, [::1], ipc://, inproc://), since a reachable unsigned pipe "
                "would unpickle whatever any peer sends"
            )
    elif not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"pipe {address!r}: the HMAC key must be bytes of length >= {MIN_KEY_BYTES} (new_pipe_key())")


def _ms(seconds: float) -> int:
    # Round up: a 0.4 ms remainder must still wait, not become a busy loop of poll(0).
    return max(0, math.ceil(seconds * 1000))


class _Pipe:
    """One ZeroMQ socket, bound or connected. Owns an asyncio socket and a sync shadow of it, so one pipe serves
    both blocking callers and asyncio frontends."""

    def __init__(self, addr: PipeAddr, bind: bool, socket_type: int):
        _check_addr(addr)
        address, key = addr
        self._mac_key = None if key is None else _mac_key(key)
        self._asock = zmq.asyncio.Context.instance().socket(socket_type)
        self._sock = zmq.Socket.shadow(self._asock.underlying)  # non-owning: only _asock.close() closes it
        self._closed = False
        try:
            self._configure(address, socket_type)
            self.addr: PipeAddr = (self._attach(address, bind), key)
        except BaseException:  # e.g. address in use: do not leak the socket
            self._asock.close(linger=0)
            raise

    def _attach(self, address: str, bind: bool) -> str:
        if not bind:
            self._sock.connect(address)
            return address
        self._sock.bind(address)
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to port 0

    def _configure(self, address: str, socket_type: int) -> None:
        # Before bind/connect: options apply only to connections made after they are set.
        s = self._sock
        s.setsockopt(zmq.LINGER, _LINGER_MS)
        s.setsockopt(zmq.SNDHWM, _HWM)
        s.setsockopt(zmq.RCVHWM, _HWM)
        s.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        if address.startswith("tcp://["):
            s.setsockopt(zmq.IPV6, 1)
        if socket_type == zmq.PULL:
            s.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)
        else:
            # Queue only on a live connection: a push to a peer that is gone (or not up yet) waits for one, and
            # put()'s timeout turns that into an error, instead of messages piling up for a peer that never returns.
            s.setsockopt(zmq.IMMEDIATE, 1)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"pipe {self.addr[0]} is closed")

    def close(self) -> None:
        """Close the socket; unsent messages get LINGER to flush. Idempotent."""
        if not self._closed:
            self._closed = True
            self._asock.close(linger=_LINGER_MS)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        signed = "signed" if self._mac_key else "unsigned"
        return f"{type(self).__name__}({self.addr[0]!r}, {signed}{', closed' if self._closed else ''})"


class PullPipe(_Pipe):
    """Receiving end. Binds by default: a worker's pull pipe or a frontend's lane has one fixed home."""

    def __init__(self, addr: PipeAddr, bind: bool = True):
        self.dropped = 0
        super().__init__(addr, bind, zmq.PULL)

    def poll(self, timeout: float) -> bool:
        """True if a message is waiting within `timeout` s. It is not yet verified: `get` may still drop it."""
        self._check_open()
        return bool(self._sock.poll(_ms(timeout), zmq.POLLIN))

    def get(self, timeout: float) -> Any:
        """The next valid message. Raises TimeoutError if none arrives within `timeout` s; drops do not extend it."""
        self._check_open()
        deadline = time.monotonic() + timeout
        while True:
            if not self._sock.poll(_ms(deadline - time.monotonic()), zmq.POLLIN):
                raise self._timeout(timeout)
            obj = self._recv_valid()
            if obj is not _NOTHING:
                return obj
            if time.monotonic() >= deadline:
                raise self._timeout(timeout)

    async def aget(self, timeout: float) -> Any:
        """`get` for asyncio callers: waits without blocking the event loop."""
        self._check_open()
        deadline = time.monotonic() + timeout
        while True:
            if not await self._asock.poll(_ms(deadline - time.monotonic()), zmq.POLLIN):
                raise self._timeout(timeout)
            obj = self._recv_valid()
            if obj is not _NOTHING:
                return obj
            if time.monotonic() >= deadline:
                raise self._timeout(timeout)

    def _recv_valid(self) -> Any:
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return _NOTHING
        return self._open(frames)

    def _open(self, frames: list[bytes]) -> Any:
        """Verify, then unpickle. Nothing from an unverified message reaches pickle."""
        if len(frames) != 2:
            return self._drop(f"{len(frames)} frames, expected 2")
        mac, payload = frames
        if self._mac_key is None:
            if mac:
                return self._drop("a signed message on an unsigned pipe")
        elif not hmac.compare_digest(mac, hmac.digest(self._mac_key, payload, "sha256")):
            return self._drop("a bad, foreign-key or missing signature")
        # A signed payload that fails to unpickle is a bug on a trusted peer: let it raise.
        return pickle.loads(payload)

    def _drop(self, reason: str) -> Any:
        self.dropped += 1
        if (self.dropped - 1) % _WARN_EVERY == 0:
            logger.warning("pipe %s dropped a message (%s); %d dropped so far", self.addr[0], reason, self.dropped)
        return _NOTHING

    def _timeout(self, timeout: float) -> TimeoutError:
        return TimeoutError(f"no valid message on pipe {self.addr[0]} within {timeout}s ({self.dropped} dropped)")


class PushPipe(_Pipe):
    """Sending end. Connects by default; messages queue (up to HWM) only while a connection to the peer is up."""

    def __init__(self, addr: PipeAddr, bind: bool = False):
        super().__init__(addr, bind, zmq.PUSH)

    def put(self, obj: Any, timeout: float = 10.0) -> None:
        """Send `obj`. Raises TimeoutError if the queue stays full (or a bound push has no peer) for `timeout` s."""
        self._check_open()
        frames = self._frames(obj)
        deadline = time.monotonic() + timeout
        while not self._try_send(frames):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(_ms(remaining), zmq.POLLOUT):
                raise self._timeout(timeout)

    async def aput(self, obj: Any, timeout: float = 10.0) -> None:
        """`put` for asyncio callers."""
        self._check_open()
        frames = self._frames(obj)
        deadline = time.monotonic() + timeout
        while not self._try_send(frames):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self._asock.poll(_ms(remaining), zmq.POLLOUT):
                raise self._timeout(timeout)

    def _frames(self, obj: Any) -> list[bytes]:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        mac = b"" if self._mac_key is None else hmac.digest(self._mac_key, payload, "sha256")
        return [mac, payload]

    def _try_send(self, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _timeout(self, timeout: float) -> TimeoutError:
        return TimeoutError(f"pipe {self.addr[0]}: could not send within {timeout}s (peer gone or queue full)")


class PushPipes:
    """Push pipes by peer address, connected on first use; past `limit` the least recently used is closed (peers
    come and go: restarts, rescaling). Belongs to one thread or event loop, like its pipes."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._pipes: OrderedDict[tuple, PushPipe] = OrderedDict()

    def get(self, addr: PipeAddr) -> PushPipe:
        key = tuple(addr)
        pipe = self._pipes.pop(key, None) or PushPipe(key)
        self._pipes[key] = pipe
        while len(self._pipes) > self.limit:
            self._pipes.popitem(last=False)[1].close()
        return pipe

    def drop(self, addr: PipeAddr) -> None:
        """Closes the pipe to a peer that is gone; a later get() connects afresh."""
        pipe = self._pipes.pop(tuple(addr), None)
        if pipe is not None:
            pipe.close()

    def close(self) -> None:
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()
