"""The owner's end of the replicas' control pipes: Abort and StopCandidates reach the replica that holds a request
(decode.worker.Accepted names its pipe), whatever happens to the call that carries the request itself."""

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
        key = tuple(addr)
        pipe = self._pipes.pop(key, None) or PushPipe(tuple(addr))
        self._pipes[key] = pipe
        while len(self._pipes) > _MAX_PIPES:
            self._pipes.popitem(last=False)[1].close()
        task = asyncio.ensure_future(pipe.aput(message, timeout=_SEND_TIMEOUT_S))
        task.add_done_callback(_log_failure)

    def close(self) -> None:
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a control message was not delivered: %s", task.exception())
