"""DisaggregatedClient: the request owner as a plain Python object, over prefill and decode Ray actors.

Same generate / generate_async API as the embedded LLM. Each request is prefilled on the prefill actor with the fewest
queued tokens, its first token is streamed at once, then it is decoded on the least loaded decode actor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Sequence

from ray.exceptions import RayActorError
from transformers import AutoTokenizer

from cluster.owner import RequestOwner
from cluster.router import Router
from engine.multimodal import MultimodalProcessor
from llmapi.batch import Prompt, as_prompt_list, split_prompt, wait_all
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.result import RequestOutput
from llmapi.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ActorRoles:
    """Roles on plain Ray actors: this owner routes (least queued tokens; images: fewest in flight) and retries a dead
    prefill actor once."""

    def __init__(self, prefill: list[Any], decode: list[Any], call_timeout_s: float, encoder: list[Any] = ()):
        self.prefill_router = Router(prefill, "prefill")
        self.decode_router = Router(decode, "decode")
        self.encoder_router = Router(list(encoder), "encoder") if encoder else None
        self.call_timeout_s = call_timeout_s
        self.colocated = False
        self._where: dict[int, Any] = {}  # request id -> the actor that holds it now

    async def encode(self, result: RequestOutput, images: tuple) -> DisaggregatedParams:
        if self.encoder_router is None:
            raise ValueError("this client was given no encoder workers: it takes no images")
        i = self.encoder_router.pick(len(images))
        try:
            return await asyncio.wait_for(self.encoder_router.workers[i].encode.remote(list(images)),
                                          self.call_timeout_s)
        finally:
            self.encoder_router.release(i, len(images))

    async def prefill(self, result: RequestOutput, images: DisaggregatedParams | None = None) -> EngineResponse:
        cost, tried = len(result.prompt_token_ids), ()
        while True:
            i = self.prefill_router.pick(cost, exclude=tried)
            worker = self._where[result.request_id] = self.prefill_router.workers[i]
            try:
                call = worker.prefill.remote(result.request_id, result.prompt_token_ids, result.sampling_params,
                                             images)
                return await asyncio.wait_for(call, self.call_timeout_s)
            except RayActorError as exc:
                tried += (i,)
                if len(tried) == len(self.prefill_router.workers):
                    raise RuntimeError(f"prefill worker {i} died and no other is left: {exc}") from exc
                log.warning("prefill worker %d died; request %d goes to another", i, result.request_id)
            finally:
                self.prefill_router.release(i, cost)
                self._where.pop(result.request_id, None)

    async def decode(self, result: RequestOutput, params: DisaggregatedParams) -> AsyncIterator[EngineResponse]:
        cost = len(result.prompt_token_ids) + result.sampling_params.max_tokens
        i = self.decode_router.pick(cost)
        worker = self._where[result.request_id] = self.decode_router.workers[i]
        try:
            refs = worker.generate.remote(result.request_id, result.prompt_token_ids, result.sampling_params, params)
            async for ref in refs:
                yield await ref
        except RayActorError as exc:
            raise RuntimeError(f"decode worker {i} died while serving request {result.request_id}: {exc}") from exc
        finally:
            self.decode_router.release(i, cost)
            self._where.pop(result.request_id, None)

    def release(self, params: DisaggregatedParams) -> None:
        self.decode_router.workers[0].release_kv.remote(params)

    def stop(self, request_id: int, indices: list[int], finished: bool) -> None:
        worker = self._where.get(request_id)
        if worker is not None:
            worker.stop_candidates.remote(request_id, indices)

    def abort(self, request_id: int) -> None:
        worker = self._where.get(request_id)
        if worker is not None:
            worker.abort.remote(request_id)


class DisaggregatedClient:
    """encoder: encoder actors, for a model with a vision tower: prompt dicts with multi_modal_data then work (the
    images are decoded and hashed here, encoded there, read by the prefill actor)."""

    def __init__(self, prefill: list[Any], decode: list[Any], tokenizer_dir: str, request_timeout_s: float = 300.0,
                 encoder: list[Any] = ()):
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.processor = MultimodalProcessor(tokenizer_dir) if encoder else None
        self.owner = RequestOwner(ActorRoles(prefill, decode, request_timeout_s, encoder), self.tokenizer,
                                  request_timeout_s)
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="raypd-owner", daemon=True)
        self._thread.start()

    def generate(self, inputs: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True, timeout: float | None = None) -> RequestOutput | list[RequestOutput]:
        prompts, single = as_prompt_list(inputs)
        results = [self.generate_async(p, sampling_params) for p in prompts]
        wait_all(results, use_tqdm, timeout)
        return results[0] if single else results

    def generate_async(self, inputs: Prompt, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        prompt, images = split_prompt(inputs)
        text, items = None, ()
        if images:
            if self.processor is None:
                raise ValueError("multi_modal_data: this client has no encoder workers; it takes no images")
            mm = self.processor.process(prompt, images)
            text = prompt if isinstance(prompt, str) else None
            prompt, items = list(mm.token_ids), mm.images
        result, record = self.owner.create(prompt, sampling_params or SamplingParams(), streaming, text=text)
        asyncio.run_coroutine_threadsafe(self.owner.run(result, record, items), self._aloop)
        return result

    def shutdown(self) -> None:
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "DisaggregatedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
