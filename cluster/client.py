"""DisaggregatedClient: the request owner on a cluster. Same generate / generate_async API as the embedded LLM;
each request is prefilled on a prefill actor, its first token streamed at once, then decoded on a decode actor."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import uuid
from typing import Any, Sequence

from ray.exceptions import RayActorError
from tqdm import tqdm
from transformers import AutoTokenizer

from cluster.router import Router
from llmapi.detokenized import DetokenizedGenerationResultBase
from llmapi.outputs import EngineResponse, TokenDelta
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams

log = logging.getLogger(__name__)
Prompt = str | list[int]


class DisaggregatedClient:
    def __init__(self, prefill: list[Any], decode: list[Any], tokenizer_dir: str, request_timeout_s: float = 300.0):
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.prefill = Router(prefill, "prefill")
        self.decode = Router(decode, "decode")
        self.request_timeout_s = request_timeout_s
        self._ids = itertools.count(uuid.uuid4().int >> 80)  # unique across owners that share workers
        self._where: dict[int, Any] = {}  # request id -> the actor that holds it now (for abort)
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="raypd-owner", daemon=True)
        self._thread.start()

    # ---- the LLM API ----
    def generate(self, inputs: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True, timeout: float | None = None) -> RequestOutput | list[RequestOutput]:
        single = isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], int))
        results = [self.generate_async(p, sampling_params) for p in ([inputs] if single else inputs)]
        for r in tqdm(results, disable=not use_tqdm or len(results) < 2, desc="raypd"):
            r.result(timeout)
        return results[0] if single else results

    def generate_async(self, inputs: Prompt, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        params = copy.deepcopy(sampling_params or SamplingParams())
        prompt, ids = (inputs, self.tokenizer.encode(inputs)) if isinstance(inputs, str) else (None, list(inputs))
        request_id = next(self._ids)
        result = RequestOutput(request_id, ids, params, prompt, streaming, abort_fn=self._abort)
        record = DetokenizedGenerationResultBase(request_id, ids, params, self.tokenizer, streaming)
        asyncio.run_coroutine_threadsafe(self._serve(result, record), self._aloop)
        return result

    def shutdown(self) -> None:
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "DisaggregatedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- one request ----
    async def _serve(self, result: RequestOutput, record: DetokenizedGenerationResultBase) -> None:
        try:
            ctx = await self._prefill(result)
            if self._deliver(result, record, _first_tokens(ctx, result.sampling_params), None):
                return
            await self._decode(result, record, ctx)
        except Exception as exc:  # every failure reaches the owner's result, named
            result.put(RequestError(str(exc)))
        finally:
            self._where.pop(result.request_id, None)

    async def _prefill(self, result: RequestOutput) -> EngineResponse:
        """Context-only on the least loaded prefill worker; a worker that dies is replaced by another once."""
        cost, tried = len(result.prompt_token_ids), ()
        while True:
            i = self.prefill.pick(cost, exclude=tried)
            worker = self._where[result.request_id] = self.prefill.workers[i]
            try:
                call = worker.prefill.remote(result.request_id, result.prompt_token_ids, result.sampling_params)
                return await asyncio.wait_for(call, self.request_timeout_s)
            except RayActorError as exc:
                tried += (i,)
                if len(tried) == len(self.prefill.workers):
                    raise RuntimeError(f"prefill worker {i} died and no other is left: {exc}") from exc
                log.warning("prefill worker %d died; request %d goes to another", i, result.request_id)
            finally:
                self.prefill.release(i, cost)

    async def _decode(self, result: RequestOutput, record, ctx: EngineResponse) -> None:
        params = result.sampling_params
        cost = len(result.prompt_token_ids) + params.max_tokens
        i = self.decode.pick(cost)
        worker = self._where[result.request_id] = self.decode.workers[i]
        dp = copy.copy(ctx.disaggregated_params)
        dp.request_type = "generation_only"
        try:
            responses = worker.generate.remote(result.request_id, result.prompt_token_ids, params, dp)
            while True:
                ref = await asyncio.wait_for(responses.__anext__(), self.request_timeout_s)
                if self._deliver(result, record, await ref, worker):
                    return
        except StopAsyncIteration:
            raise RuntimeError(f"decode worker {i} ended request {result.request_id} without a final response")
        except RayActorError as exc:
            raise RuntimeError(f"decode worker {i} died while serving request {result.request_id}: {exc}") from exc
        finally:
            self.decode.release(i, cost)

    def _deliver(self, result: RequestOutput, record, rsp: EngineResponse, worker) -> bool:
        """Post-processes one response into the result; True once the request is finished."""
        delta, to_stop = record.handle(rsp)
        if to_stop and worker is not None:
            worker.stop_candidates.remote(rsp.request_id, to_stop)
        if delta is not None:
            result.put(delta)
        return record.finished

    def _abort(self, request_id: int) -> None:
        worker = self._where.get(request_id)
        if worker is not None:
            worker.abort.remote(request_id)


def _first_tokens(ctx: EngineResponse, params: SamplingParams) -> EngineResponse:
    """The prefill worker's response as the owner streams it: a candidate is finished only if its first token ended
    it (EOS, a stop token, max_tokens 1, cancelled); otherwise decoding goes on."""
    def final(d: TokenDelta) -> bool:
        return d.finish_reason not in (None, "length") or params.max_tokens == 1

    deltas = tuple(d if final(d) else TokenDelta(d.index, d.token_ids, d.cumulative_logprob, d.logprobs)
                   for d in ctx.deltas)
    finished = all(final(d) for d in ctx.deltas) or ctx.error is not None
    return EngineResponse(ctx.request_id, deltas, finished, ctx.error, ctx.queue_time, ctx.prompt_logprobs,
                          ctx.context_logits, ctx.disaggregated_params)
