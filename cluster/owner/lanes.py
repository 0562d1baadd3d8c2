"""The owner's lane on the postproc workers, kept registered while Ray restarts them.

Postproc workers push each request's outputs to the lane of the owner that holds it. A worker that dies takes its
lane registration (and its pipe) with it; Ray restarts it with a new pipe. OwnerLanes polls every worker: one that
does not answer or answers with a new pipe is lost — the owner resumes its requests without it — and once it answers
again this lane is registered with the new instance. While any worker is down, new requests skip the postproc path.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable

import ray

from llmapi.outputs import RequestDelta
from postproc.routing import Lane, Output
from postproc.sink import ResultSink
from protocol import PipeAddr, PostprocRoute, postproc_worker

log = logging.getLogger(__name__)

POLL_S = 0.5
_CALL_S = 2.0
_MISSES = 3
_START_S = 60.0
LANE_GRACE_S = 5.0  # after the engine is done, the final output must come through the postproc worker within this


class PostprocLost(RuntimeError):
    """The postproc worker carrying a request's tokens is gone (or restarted)."""


class PromptInputsLost(RuntimeError):
    """The engine serving a request could not read what its prompt needs from another replica (the prompt's KV, its
    images' embeddings) and cannot compute it itself (RequestDelta.retry_whole): the owner serves it again whole,
    with fresh embeddings."""


def retry_whole(item) -> PromptInputsLost | None:
    """What to raise instead of applying this item of a replica's stream, if it is an engine response asking for the
    request to be served again."""
    return PromptInputsLost(item.error) if isinstance(item, RequestDelta) and item.retry_whole else None


class LaneWaits:
    """The owner's requests whose tokens come back on its lane, each waiting for its final output. All on the
    owner's event loop (OwnerLanes hands it each Output there)."""

    def __init__(self):
        self._waiting: dict[int, tuple[ResultSink, asyncio.Future]] = {}  # engine id -> its sink, final output

    async def wait(self, engine_id: int, sink: ResultSink, call: Awaitable[None], num_workers: int) -> None:
        """Runs `call` (the replica call feeding the lane) until the request's final output has arrived. Raises what
        lost the call, PromptInputsLost when the engine asks for the request to be served again whole, or PostprocLost
        when its postproc worker is lost or the final output does not follow the call's end within LANE_GRACE_S."""
        final = asyncio.get_running_loop().create_future()
        self._waiting[engine_id] = (sink, final)
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait({task, final}, return_when=asyncio.FIRST_COMPLETED)
            if final.done():
                final.result()  # raises PostprocLost or PromptInputsLost
                return
            task.result()  # raises what lost the call
            await asyncio.wait_for(asyncio.shield(final), LANE_GRACE_S)
        except asyncio.TimeoutError:
            worker = postproc_worker(engine_id, num_workers)
            raise PostprocLost(f"no final output from postproc worker {worker} within {LANE_GRACE_S} s") from None
        finally:
            task.cancel()
            self._waiting.pop(engine_id, None)

    def on_output(self, out: Output) -> None:
        """One postproc Output for a request of this owner."""
        entry = self._waiting.get(out.client_id)
        if entry is None:
            return  # a late output of a request resumed since, or gone
        sink, final = entry
        lost = retry_whole(out.res)
        if lost is not None:
            if not final.done():
                final.set_exception(lost)
            return
        sink.apply(out.res, out.should_abort)
        if out.is_final and not final.done():
            final.set_result(None)

    def on_postproc_lost(self, worker: int, count: int, why: str) -> None:
        """Postproc worker `worker` (of `count`) is gone: its requests are resumed without it."""
        for engine_id, (_, final) in list(self._waiting.items()):
            if postproc_worker(engine_id, count) == worker and not final.done():
                final.set_exception(PostprocLost(f"postproc worker {worker} was lost ({why})"))


class OwnerLanes:
    def __init__(self, postprocs: list, on_output: Callable[[Output], None], loop: asyncio.AbstractEventLoop,
                 host: str):
        self.postprocs = list(postprocs)
        self.lane = Lane(ToLoop(loop, on_output), host=host)
        addrs = ray.get([p.pull_pipe_addr.remote() for p in self.postprocs], timeout=_START_S)
        self._addrs: list[PipeAddr] = [tuple(a) for a in addrs]  # each worker instance's pipe: its identity
        self._lanes: list[int | None] = ray.get([p.add_lane.remote(self.lane.addr) for p in self.postprocs],
                                                timeout=_START_S)
        self.down: dict[int, str] = {}  # worker -> why it is down
        self._misses = [0] * len(self.postprocs)  # consecutive polls without an answer

    def route(self, streaming: bool) -> PostprocRoute | None:
        if self.down:
            return None
        return PostprocRoute(tuple(self._lanes), streaming)

    def health(self) -> str | None:
        """None when every postproc worker is up, else which are not."""
        if not self.down:
            return None
        return "; ".join(f"postproc worker {i} is {why}" for i, why in sorted(self.down.items()))

    async def watch(self, on_lost: Callable[[int, int, str], None]) -> None:
        """Runs until cancelled: on_lost(worker, count, why) for each worker lost."""
        while True:
            await asyncio.sleep(POLL_S)
            for i in range(len(self.postprocs)):
                try:
                    await self._check(i, on_lost)
                except Exception:  # never let one bad poll end the watch
                    log.exception("checking postproc worker %d failed", i)

    async def _check(self, i: int, on_lost) -> None:
        actor, n = self.postprocs[i], len(self.postprocs)
        try:
            addr = tuple(await asyncio.wait_for(actor.pull_pipe_addr.remote(), _CALL_S))
            self._misses[i] = 0
        except Exception as exc:
            # A dead actor says so at once; a slow answer is only a busy host until it happens MISSES times.
            self._misses[i] += 1
            if i not in self.down and (not isinstance(exc, asyncio.TimeoutError) or self._misses[i] >= _MISSES):
                self.down[i] = "not answering (restarting?)"
                log.warning("postproc worker %d is not answering: its requests are resumed without it", i)
                on_lost(i, n, "not answering")
            return
        if addr == self._addrs[i] and i not in self.down:
            return
        if addr != self._addrs[i] and i not in self.down:
            on_lost(i, n, "restarted")
        self._lanes[i] = await asyncio.wait_for(actor.add_lane.remote(self.lane.addr), _CALL_S * 5)
        self._addrs[i] = addr
        self.down.pop(i, None)
        log.warning("postproc worker %d is back", i)

    def close(self) -> None:
        self.lane.close()


class ToLoop:
    """Hands outputs from the lane's thread to the owner's event loop, in order, with one wakeup of the loop per
    burst: at 16 streams a step's outputs arrive together, and a wakeup each (a self-pipe write, a loop iteration)
    cost more than delivering them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Output], None]):
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._pending: list[Output] = []

    def __call__(self, out: Output) -> None:
        with self._lock:
            self._pending.append(out)
            if len(self._pending) > 1:
                return  # a flush is already scheduled and will take this one too
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            outputs, self._pending = self._pending, []
        for out in outputs:
            try:
                self._deliver(out)
            except Exception:  # one bad delivery must not drop the rest of the burst
                log.exception("delivering the output of request %s failed",
                              getattr(out, "client_id", None) or getattr(out, "request_id", None))
