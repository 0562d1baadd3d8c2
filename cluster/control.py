"""The owner's end of the replicas' control pipes: Abort and StopCandidates reach the replica that holds a request
(decode.worker.Accepted names its pipe), whatever happens to the call that carries the request itself; an idle
owner's direct starts go the same way (cluster/direct.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from postproc.pipes import PipeAddr, PushPipe

log = logging.getLogger(__name__)

_SEND_TIMEOUT_S = 2.0
_MAX_PIPES = 64  # replicas come and go (restarts, rescaling): the least recently used pipe is closed past this


class ControlClient:
    """Belongs to one event loop (the owner's)."""

    def __init__(self):
        self._pipes: OrderedDict[tuple, PushPipe] = OrderedDict()

    def send(self, addr: PipeAddr, message) -> None:
        """Sends without waiting; a replica that is gone loses nothing (its requests went with it)."""
        task = asyncio.ensure_future(self._pipe(addr).aput(message, timeout=_SEND_TIMEOUT_S))
        task.add_done_callback(_log_failure)

    async def deliver(self, addr: PipeAddr, message, timeout: float) -> None:
        """Sends and waits until the pipe took the message; TimeoutError if it does not within timeout (the
        replica is gone)."""
        await self._pipe(addr).aput(message, timeout=timeout)

    def _pipe(self, addr: PipeAddr) -> PushPipe:
        key = tuple(addr)
        pipe = self._pipes.pop(key, None) or PushPipe(key)
        self._pipes[key] = pipe
        while len(self._pipes) > _MAX_PIPES:
            self._pipes.popitem(last=False)[1].close()
        return pipe

    def close(self) -> None:
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a control message was not delivered: %s", task.exception())
