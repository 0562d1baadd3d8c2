"""PostprocPool: the embedded LLM's postproc workers, N processes on this host, and the lane that feeds its results.

The LLM's engine thread calls `submit` (once the engine accepted a request) and `send` (each step's responses); the
lane thread puts each Output's RequestDelta into the request's result and hands `should_abort` to `stop_candidates`,
which the LLM turns into a command for its engine thread (engine.stop_candidate frees the blocks). If a worker dies,
every open request fails with its name and is aborted in the engine (`abort`), and later ones fail at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

from llmapi.outputs import RequestDelta
from llmapi.result import GenerationResult
from postproc.pipes import new_pipe_key, tcp_address
from postproc.routing import Lane, Output, PostprocSender
from postproc.sink import ResultSink
from postproc.worker import PostprocParams
from postproc.worker_main import decode_addr, encode_addr
from protocol import PipeAddr

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a new interpreter imports transformers: seconds on a busy 2-core host
_STOP_TIMEOUT_S = 10.0

StopCandidates = Callable[[int, tuple[int, ...]], None]
Abort = Callable[[int], None]


class WorkerProcess:
    """One worker process, `python -m postproc.worker_main`, with the part of multiprocessing.Process's interface
    the pool uses. Its stdin stays open for its lifetime: the worker exits when it closes, so it never outlives us."""

    def __init__(self, name: str, settings: dict):
        self.name = name
        reply_r, reply_w = os.pipe()
        package_root = str(pathlib.Path(__file__).resolve().parents[1])  # -m finds this very copy of postproc
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "postproc.worker_main", str(reply_w)],
                                          stdin=subprocess.PIPE, pass_fds=(reply_w,), env=env)
        finally:
            os.close(reply_w)
        self.reply = Connection(reply_r, writable=False)
        self._proc.stdin.write(json.dumps(settings).encode() + b"\n")
        self._proc.stdin.flush()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def close(self) -> None:
        """After it exited (or was killed): frees the pipes."""
        self.reply.close()
        self._proc.stdin.close()


class PostprocPool:
    """N worker processes (each `python -m postproc.worker_main`), their sender and the LLM's lane."""

    def __init__(self, tokenizer_dir: str, num_workers: int, stop_candidates: StopCandidates, abort: Abort,
                 post_processor_hook: str | None = None):
        if num_workers < 1:
            raise ValueError(f"PostprocPool needs num_workers >= 1, got {num_workers}")
        self._stop_candidates = stop_candidates
        self._abort = abort  # not stop_candidates: a request not yet scheduled has no candidates to stop
        self._sinks: dict[int, ResultSink] = {}
        self._lock = threading.Lock()  # _sinks is shared by the engine thread and the lane thread
        self._broken: BaseException | None = None
        self._closing = False
        self._lane = Lane(self._on_output, on_tick=self._check_workers, name="raypd-postproc-lane")
        self._procs: list[WorkerProcess] = []
        try:
            addrs = self._spawn(tokenizer_dir, num_workers, post_processor_hook)
            self._sender = PostprocSender(addrs)
        except BaseException:
            for proc in self._procs:  # the others started fine but will never get a Shutdown: no grace period
                proc.terminate()
            self._stop_processes()
            self._lane.close()
            raise

    def _spawn(self, tokenizer_dir: str, n: int, hook: str | None) -> list[PipeAddr]:
        # New interpreters, not fork (which would copy the engine thread's state and locks) nor multiprocessing's
        # spawn (which re-imports the caller's __main__): see postproc.worker_main.
        for i in range(n):
            settings = {"pull_addr": encode_addr((tcp_address("127.0.0.1"), new_pipe_key())),
                        "lane_addr": encode_addr(self._lane.addr), "tokenizer_dir": tokenizer_dir, "hook": hook,
                        "sys_path": [str(p) for p in sys.path]}
            self._procs.append(WorkerProcess(f"raypd-postproc-{i}", settings))
        deadline = time.monotonic() + _START_TIMEOUT_S
        return [self._started(i, proc, deadline) for i, proc in enumerate(self._procs)]

    def _started(self, i: int, proc: WorkerProcess, deadline: float) -> PipeAddr:
        if not proc.reply.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"postproc worker {i} did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            reply = json.loads(proc.reply.recv_bytes())
        except EOFError:
            proc.join(1.0)
            raise RuntimeError(f"postproc worker {i} exited while starting (code {proc.exitcode})") from None
        if "error" in reply:
            raise RuntimeError(f"postproc worker {i} failed to start: {reply['error']}")
        return decode_addr(reply["pull_addr"])

    # ---- engine thread ----
    def submit(self, request_id: int, result: GenerationResult) -> None:
        """Routes the request's outputs to `result`; call after the engine accepted the request."""
        if self._broken is not None:
            result.put(self._broken)
            self._abort(request_id)
            return
        with self._lock:
            self._sinks[request_id] = ResultSink(result, functools.partial(self._stop_candidates, request_id))
        params = PostprocParams(lane=0, prompt_token_ids=tuple(result.prompt_token_ids))
        self._sender.submit(request_id, result.sampling_params, params, result.streaming, result.disaggregated_params)

    def send(self, responses: list[RequestDelta]) -> None:
        if not responses:
            return
        for request_id in self._sender.send(responses):  # their worker is gone: they cannot finish
            with self._lock:
                sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.result.put(RuntimeError(f"postproc worker {self._sender.worker_of(request_id)} takes no "
                                        "messages: the request cannot finish"))
                self._abort(request_id)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink.result.put(exc)

    def close(self) -> None:
        """Stops the workers (Shutdown, then terminate past a deadline) and the lane; after the engine thread ended."""
        self._closing = True
        self._sender.shutdown_workers()
        self._stop_processes()
        self._sender.close()
        self._lane.close()

    def _stop_processes(self) -> None:
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("postproc worker %s did not stop in time: terminating it", proc.name)
                proc.terminate()
                proc.join(2.0)
            proc.close()

    # ---- lane thread ----
    def _on_output(self, out: Output) -> None:
        with self._lock:
            sink = self._sinks.pop(out.client_id, None) if out.is_final else self._sinks.get(out.client_id)
        if sink is not None:
            sink.apply(out.res, out.should_abort)

    def _check_workers(self) -> None:
        dead = [p for p in self._procs if p.exitcode is not None]
        if self._closing or not dead or self._broken is not None:
            return
        self._broken = RuntimeError(f"postproc worker {dead[0].name} (pid {dead[0].pid}) exited with code "
                                    f"{dead[0].exitcode}: its requests cannot finish")
        with self._lock:
            open_requests, self._sinks = self._sinks, {}
        for request_id, sink in open_requests.items():
            sink.result.put(self._broken)
            self._abort(request_id)
