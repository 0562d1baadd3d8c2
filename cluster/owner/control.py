"""The owner's end of the replicas' control pipes: Abort and StopCandidates reach the replica that holds a request
(decode.worker.Accepted names its pipe), whatever happens to the call that carries the request itself; an idle
owner's direct starts go the same way (cluster/owner/direct.py)."""

from __future__ import annotations

import asyncio
import logging

from postproc.pipes import PushPipes
from protocol import PipeAddr

log = logging.getLogger(__name__)

_SEND_TIMEOUT_S = 2.0


class ControlClient:
    """Belongs to one event loop (the owner's)."""

    def __init__(self):
        self._pipes = PushPipes()

    def send(self, addr: PipeAddr, message) -> None:
        """Sends without waiting; a replica that is gone loses nothing (its requests went with it)."""
        task = asyncio.ensure_future(self._pipes.get(addr).aput(message, timeout=_SEND_TIMEOUT_S))
        task.add_done_callback(_log_failure)

    async def deliver(self, addr: PipeAddr, message, timeout: float) -> None:
        """Sends and waits until the pipe took the message; TimeoutError if it does not within timeout (the
        replica is gone)."""
        await self._pipes.get(addr).aput(message, timeout=timeout)

    def close(self) -> None:
        self._pipes.close()


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a control message was not delivered: %s", task.exception())
