"""The embedded LLM: the engine in-process, its loop on a background thread, results owned by the caller."""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from typing import Sequence

from tqdm import tqdm
from transformers import AutoTokenizer

from engine.engine import EngineConfig, LLMEngine
from llmapi.detokenized import DetokenizedGenerationResultBase
from llmapi.outputs import EngineResponse
from llmapi.result import RequestOutput
from llmapi.sampling_params import SamplingParams

Prompt = str | list[int]
_IDLE_WAIT_S = 0.05


class LLM:
    """`LLM(model=DIR)`: generate() for batches, generate_async() for one request (streaming or not)."""

    def __init__(self, model: str, engine_config: EngineConfig | None = None, **engine_kwargs):
        self.model_dir = model
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = LLMEngine(model, engine_config or EngineConfig(**engine_kwargs))
        self._ids = itertools.count()
        self._commands: queue.Queue = queue.Queue()
        self._records: dict[int, tuple[DetokenizedGenerationResultBase, RequestOutput]] = {}
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="raypd-engine", daemon=True)
        self._thread.start()

    # ---- public API ----
    def generate(
        self,
        inputs: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        timeout: float | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generates for one prompt (returns one RequestOutput) or many (returns a list, in order)."""
        single = isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], int))
        prompts = [inputs] if single else list(inputs)
        params = _per_prompt(sampling_params, len(prompts))
        results = [self.generate_async(p, sp) for p, sp in zip(prompts, params)]
        for r in tqdm(results, disable=not use_tqdm or len(results) < 2, desc="raypd"):
            r.result(timeout)
        return results[0] if single else results

    def generate_async(self, inputs: Prompt, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        """Submits one request and returns at once; iterate the result to stream, or call result(timeout)."""
        self._check_alive()
        params = copy.deepcopy(sampling_params or SamplingParams())
        prompt, ids = self._tokenize(inputs)
        request_id = next(self._ids)
        result = RequestOutput(request_id, ids, params, prompt, streaming, abort_fn=self._abort)
        record = DetokenizedGenerationResultBase(request_id, ids, params, self.tokenizer, streaming)
        done = threading.Event()
        self._commands.put(("add", request_id, (record, result), done))
        self._wait_command(done)
        return result

    def shutdown(self) -> None:
        """Stops the loop; unfinished requests end with an error."""
        self._stopped.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers run on the caller's thread ----
    def _tokenize(self, inputs: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(inputs, str):
            return inputs, self.tokenizer.encode(inputs)
        if isinstance(inputs, (list, tuple)) and all(isinstance(t, int) for t in inputs):
            return None, list(inputs)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(inputs).__name__}")

    def _abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id, None, None))

    def _wait_command(self, done: threading.Event) -> None:
        # The loop validates the request; an error there is re-raised here, on the caller's thread.
        if not done.wait(timeout=60):
            raise TimeoutError("the engine loop did not accept the request within 60 s")
        if getattr(done, "error", None) is not None:
            raise done.error

    def _check_alive(self) -> None:
        if self._stopped.is_set() or self._failure is not None:
            raise RuntimeError(f"the LLM is shut down{f' ({self._failure})' if self._failure else ''}")

    # ---- the loop (engine thread) ----
    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                self._run_commands(block=not self.engine.has_unfinished_requests())
                for rsp in self.engine.step():
                    self._deliver(rsp)
        except BaseException as exc:  # a broken engine fails every request loudly instead of hanging them
            self._failure = exc
        self._fail_all(self._failure or RuntimeError("the LLM was shut down"))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, kind: str, request_id: int, payload, done: threading.Event | None) -> None:
        if kind == "abort":
            self.engine.abort_request(request_id)
            return
        record, result = payload
        try:
            self.engine.add_request(request_id, result.prompt_token_ids, result.sampling_params)
            self._records[request_id] = payload
        except ValueError as exc:
            done.error = exc
        done.set()

    def _deliver(self, rsp: EngineResponse) -> None:
        record, result = self._records.get(rsp.request_id, (None, None))
        if record is None:
            return
        delta, to_stop = record.handle(rsp)
        for index in to_stop:
            self.engine.stop_candidate(rsp.request_id, index)
        if delta is not None:
            result.put(delta)
        if record.finished:
            del self._records[rsp.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for _, result in self._records.values():
            result.put(exc)
        self._records.clear()


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts: pass one, or one per prompt")
    return params
