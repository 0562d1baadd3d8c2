"""EngineLoop: an LLMEngine on its own thread, so whoever hosts it (the embedded LLM, a Ray actor) never blocks.

Everything that touches the engine runs on that thread: callers hand it functions (`call` waits for the result,
`post` does not), and each step's responses go to a sink the host provides.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

from engine.core.engine import LLMEngine
from llmapi.outputs import RequestDelta

T = TypeVar("T")
# How long the loop waits for new work (which ends the wait at once) before it steps again when there is nothing to
# compute. Leases held for other engines' reads still advance at this pace: a release frees its blocks at most this
# late, and blocks a new request needs are freed in that request's own step.
_IDLE_WAIT_S = 0.02
# With KV reads in flight the loop polls them this often instead of spinning (a spin would hold the GIL from the
# threads that bring new work and send outputs): a finished read starts decoding within a millisecond.
_POLL_WAIT_S = 0.001


class EngineLoop:
    def __init__(self, engine: LLMEngine, sink: Callable[[list[RequestDelta]], None],
                 on_failure: Callable[[BaseException], None], name: str = "raypd-engine"):
        self.engine = engine
        self._sink = sink
        self._on_failure = on_failure
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stopped = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Runs fn(engine) on the loop thread; the future holds its result or its exception."""
        self.check_alive()
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, not swallowed
                future.set_exception(exc)

        self._work.put(run)
        return future

    def call(self, fn: Callable[[LLMEngine], T], timeout: float = 60.0) -> T:
        """submit() and wait for the result. Never from the loop thread itself (use post there)."""
        return self.submit(fn).result(timeout=timeout)

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Runs fn(engine) on the loop thread some time soon; its result is dropped."""
        self._work.put(lambda: fn(self.engine))

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the engine loop failed: {self.failure!r}")
        if self._stopped.is_set():
            raise RuntimeError("the engine loop is shut down")

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopped.set()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(self._wait_s())
                responses = self.engine.step()
                if responses:
                    self._sink(responses)
        except BaseException as exc:  # a broken engine fails every request loudly instead of hanging them
            self.failure = exc
        self._on_failure(self.failure or RuntimeError("the engine was shut down"))
        self.engine.close()

    def _wait_s(self) -> float:
        """How long to wait for new work before the next step (new work ends the wait at once)."""
        if self.engine.has_runnable():
            return 0.0
        # Leases alone need no fast poll: a prefill replica under load always holds some, and woke 1000 times a second.
        return _POLL_WAIT_S if self.engine.has_kv_reads() else _IDLE_WAIT_S

    def _drain(self, wait_s: float) -> None:
        try:
            work = self._work.get(timeout=wait_s) if wait_s else self._work.get_nowait()
        except queue.Empty:
            return
        while True:
            work()
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                return
