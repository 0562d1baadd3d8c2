"""The owner's end of the replicas' control pipes: Abort and StopCandidates reach the replica that holds a request
(protocol.Accepted names its pipe), whatever happens to the call that carries the request itself; an idle
owner's direct starts go the same way (cluster/owner/direct.py)."""

from __future__ import annotations

import asyncio
import logging

from postproc.pipes import PushPipes
from protocol import Abort, Accepted, PipeAddr, StopCandidates

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


class Holders:
    """The replicas holding one request, by role (the control pipe each one's Accepted named, and the request's id
    there), and the control messages that reach them."""

    def __init__(self, control: ControlClient):
        self._control = control
        self._by_role: dict[str, tuple[PipeAddr, int]] = {}

    def hold(self, role: str, accepted: Accepted, engine_id: int, aborted: bool) -> None:
        self._by_role[role] = (tuple(accepted.control), engine_id)
        if aborted:  # the abort came before the replica was known
            self._control.send(accepted.control, Abort(engine_id))

    def took(self, role: str, engine_id: int) -> bool:
        """Whether a replica of the role accepted the request under this id."""
        return self._by_role.get(role, (None, None))[1] == engine_id

    def abort_all(self) -> None:
        for addr, engine_id in self._by_role.values():
            self._control.send(addr, Abort(engine_id))

    def stop(self, role: str, indices: tuple[int, ...]) -> None:
        holder = self._by_role.get(role)
        if holder is not None:
            self._control.send(holder[0], StopCandidates(holder[1], tuple(indices)))

    def release(self, role: str, engine_id: int) -> None:
        """The call ended without the request's end: make sure its replica (if alive) frees it."""
        if self.took(role, engine_id):
            self._control.send(self._by_role[role][0], Abort(engine_id))


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a control message was not delivered: %s", task.exception())
