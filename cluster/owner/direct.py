"""Direct starts: an idle owner sends a request straight to a decode replica's control pipe instead of calling it
through Serve (protocol.Start), and hears back on a reply pipe of its own what the call would have streamed.

Measured on a 2-core host at concurrency 1, a Serve call costs ~4 ms between the owner and the engine taking the
request (the owner's handle and router thread, gRPC, the replica's loop, Accepted back); the pipe ~1.5 ms. Only an
owner that serves nothing else starts directly: there the replica's load from the directory (a second old at most)
picks as well as Serve's router would. Under load every request goes through Serve, whose router accounts for what
is in flight, whose queue limits apply and whose autoscaling counts the call.

The owner reaches a replica's pipe only once that replica has accepted a call of its (Accepted names the pipe and the
Serve replica), so the pipe's signing key never goes through the directory; while any live decode replica is still
unknown, nothing starts directly (it might be the best one). What a call gets from Serve the owner does here:
- not accepted (the pipe takes no message, or no Accepted within the owner's accept timeout): NotAccepted;
- the replica lost after it accepted: its directory entry goes stale or is removed (a replica that stops leaves the
  directory), and the request fails with ReplicaGone within a directory period of that; the owner resumes it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Iterable

from cluster.owner.control import ControlClient
from cluster.serving.directory import Entry
from cluster.owner.lanes import ToLoop
from cluster.routing.policy import ReplicaState, prompt_block_keys, replica_cost
from postproc.pipes import PullPipe, new_pipe_key, tcp_address
from protocol import Accepted, Done, PipeAddr, Reply, Start, Submit

log = logging.getLogger(__name__)

_SEND_TIMEOUT_S = 1.0  # a live replica's pipe takes a message at once
_POLL_S = 0.1


class ReplicaGone(RuntimeError):
    """The replica serving a direct start left the directory (killed, or stopped by Serve)."""


class DirectStarts:
    """Belongs to the owner's event loop; update() may be called from any thread."""

    def __init__(self, control: ControlClient, loop: asyncio.AbstractEventLoop, host: str):
        self._control = control
        self._loop = loop
        self._pipes: dict[str, PipeAddr] = {}  # Serve replica id -> its control pipe, from Accepted
        self._live: tuple[tuple[str, ReplicaState | None], ...] = ()  # the decode replicas in the directory
        self._calls: dict[int, tuple[str, asyncio.Queue]] = {}  # request id -> (replica id, what it reported)
        self._pull = PullPipe((tcp_address(host), new_pipe_key()))
        self.reply_addr: PipeAddr = self._pull.addr
        self._deliver = ToLoop(loop, self._on_reply)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="raypd-direct-replies", daemon=True)
        self._thread.start()

    def learn(self, accepted: Accepted) -> None:
        """A decode replica accepted a call: its pipe, by its replica id."""
        if accepted.replica is not None:
            self._pipes[accepted.replica] = tuple(accepted.control)

    def update(self, decode_entries: Iterable[Entry]) -> None:
        """The decode replicas' latest directory entries (Directory.entries("decode")); requests on replicas no
        longer among them fail with ReplicaGone."""
        live = tuple((e.replica_id, ReplicaState.from_json(e.routing)) for e in decode_entries)
        self._live = live
        self._loop.call_soon_threadsafe(self._fail_gone, frozenset(rid for rid, _ in live))

    def choose(self, prompt_token_ids: list[int], cache_salt: str | None) -> tuple[str, PipeAddr] | None:
        """(replica id, control pipe) of the decode replica that would finish the prompt soonest; None while a
        live one's pipe or state is unknown."""
        live = self._live
        if not live or any(rid not in self._pipes or state is None for rid, state in live):
            return None
        keys: dict[int, list[bytes]] = {}

        def cost(item: tuple[str, ReplicaState]) -> int:
            state = item[1]
            if state.block_size not in keys:
                keys[state.block_size] = prompt_block_keys(prompt_token_ids, state.block_size, cache_salt)
            return replica_cost(state, keys[state.block_size], len(prompt_token_ids))
        rid = live[0][0] if len(live) == 1 else min(live, key=cost)[0]
        return rid, self._pipes[rid]

    async def call(self, target: tuple[str, PipeAddr], submit: Submit) -> AsyncIterator[Accepted | Done]:
        """As a routed call streams it: Accepted, then Done once the engine is done."""
        replica, pipe = target
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[submit.request_id] = (replica, queue)
        try:
            start = Start(submit, self.reply_addr)
            try:
                await self._control.deliver(pipe, start, _SEND_TIMEOUT_S)
            except TimeoutError:
                self._pipes.pop(replica, None)  # learned again from its next Accepted, if it is still there
                raise ReplicaGone("the decode replica takes no messages") from None
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            self._calls.pop(submit.request_id, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_S + 1)

    # ---- replies (their own thread; handed to the owner's loop) ----
    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    reply = self._pull.get(timeout=_POLL_S)
                except TimeoutError:
                    continue
                if isinstance(reply, Reply):
                    self._deliver(reply)
        finally:
            self._pull.close()

    def _on_reply(self, reply: Reply) -> None:
        call = self._calls.get(reply.request_id)
        if call is not None:
            call[1].put_nowait(reply.item)

    def _fail_gone(self, live: frozenset[str]) -> None:
        for request_id, (replica, queue) in list(self._calls.items()):
            if replica not in live:
                queue.put_nowait(ReplicaGone("the decode replica left the replica directory"))
        for replica in [r for r in self._pipes if r not in live]:
            del self._pipes[replica]
