"""The two ends around the postproc workers: what an engine uses to send, what a frontend (request owner) receives on.

PostprocSender (engine side): one PushPipe per worker; each step's RequestDeltas go to worker `request_id % N`,
one message per worker. A request's parameters are handed over once (`submit`) and ride on its first Input.
Lane (frontend side): a bound PullPipe that workers push this frontend's Outputs to, drained by a thread.
Request ids must be unique among the requests the workers hold at once, across all frontends.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import RequestDelta
from llmapi.sampling_params import SamplingParams
from postproc.pipes import PullPipe, PushPipe, new_pipe_key, tcp_address
from protocol import PipeAddr, postproc_worker
from postproc.worker import PostprocParams, PostprocWorker, Shutdown

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0  # a live worker takes a step's message at once; longer means it is gone
_LANE_POLL_S = 0.1
_TICK_EVERY_S = 0.5

Input = PostprocWorker.Input
Output = PostprocWorker.Output


class PostprocSender:
    """Engine side. Belongs to one thread (the engine loop's), like the pipes it holds.

    A worker that takes no message within SEND_TIMEOUT_S is marked down: its requests fail at once (their owners
    resume them elsewhere) until reconnect() gives it a new address (a restarted worker binds a new pipe).
    """

    def __init__(self, worker_addrs: list[PipeAddr]):
        if not worker_addrs:
            raise ValueError("PostprocSender needs at least one postproc worker address")
        self._addrs = list(worker_addrs)
        self._pipes = [PushPipe(addr) for addr in worker_addrs]
        self._down: set[int] = set()
        self._first: dict[int, tuple] = {}  # request_id -> what its first Input carries besides rsp

    @property
    def num_workers(self) -> int:
        return len(self._pipes)

    def worker_of(self, request_id: int) -> int:
        return postproc_worker(request_id, len(self._pipes))

    def is_down(self, worker: int) -> bool:
        return worker in self._down

    def reconnect(self, worker: int, addr: PipeAddr) -> None:
        """Points worker's pipe at addr (a restarted worker's new pipe); it is up again."""
        if tuple(addr) == tuple(self._addrs[worker]) and worker not in self._down:
            return
        self._pipes[worker].close()
        self._addrs[worker], self._pipes[worker] = addr, PushPipe(addr)
        self._down.discard(worker)

    def submit(self, request_id: int, sampling_params: SamplingParams, postproc_params: PostprocParams,
               streaming: bool = False, disaggregated_params: DisaggregatedParams | None = None) -> None:
        """Remembers a request's parameters until its first response is sent. Call once the engine accepted it."""
        self._first[request_id] = (sampling_params, postproc_params, disaggregated_params, streaming)

    def send(self, responses: list[RequestDelta]) -> list[int]:
        """Sends one step's responses, one message per worker that has any; returns the request ids whose worker
        is down (nothing of theirs was sent)."""
        by_worker: dict[int, list[Input | RequestDelta]] = {}
        for rsp in responses:
            first = self._first.pop(rsp.request_id, None)
            inp = rsp if first is None else Input(rsp, *first)
            by_worker.setdefault(self.worker_of(rsp.request_id), []).append(inp)
        failed = []
        for worker, inputs in by_worker.items():
            if worker not in self._down:
                try:
                    self._pipes[worker].put(inputs, timeout=SEND_TIMEOUT_S)
                    continue
                except TimeoutError as exc:
                    logger.error("postproc worker %d takes no messages (%s): marked down", worker, exc)
                    self._down.add(worker)
            failed += [i.request_id if type(i) is RequestDelta else i.rsp.request_id for i in inputs]
        return failed

    def shutdown_workers(self) -> None:
        """Asks every worker to stop after what it has queued; errors are logged, so shutdown never stops halfway."""
        for pipe in self._pipes:
            try:
                pipe.put(Shutdown(), timeout=1.0)
            except (TimeoutError, RuntimeError) as exc:
                logger.warning("could not send Shutdown on %s: %s", pipe.addr[0], exc)

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()


class Lane:
    """Frontend side: binds a signed pull pipe on `host` and calls on_output(Output) for each arrival, on its thread.

    `on_tick()` (optional) runs on the same thread about every 0.5 s, e.g. to notice a dead worker.
    Register `addr` with every postproc worker (PostprocWorker.add_lane) before routing requests to it.
    """

    def __init__(self, on_output: Callable[[Output], None], host: str = "127.0.0.1",
                 on_tick: Callable[[], None] | None = None, name: str = "raypd-lane"):
        self._on_output = on_output
        self._on_tick = on_tick
        self._pull = PullPipe((tcp_address(host), new_pipe_key()))
        self.addr: PipeAddr = self._pull.addr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._pull.dropped

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (which closes the pipe); idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        next_tick = time.monotonic() + _TICK_EVERY_S
        try:
            while not self._stop.is_set():
                self._drain()
                if self._on_tick is not None and time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + _TICK_EVERY_S
                    self._on_tick()
        finally:
            self._pull.close()

    def _drain(self) -> None:
        try:
            outputs = self._pull.get(timeout=_LANE_POLL_S)
        except TimeoutError:
            return
        for fields in outputs:
            out = Output._make(fields)
            try:
                self._on_output(out)
            except Exception:  # one bad delivery must not stop the lane for every other request
                logger.exception("delivering the output of request %s failed", out.client_id)
