"""DisaggregatedClient: the request owner as a plain Python object, over prefill and decode Ray actors.

Same generate / generate_async API as the embedded LLM. Each request is prefilled on the prefill actor with the fewest
queued tokens, its first token is streamed at once, then it is decoded on the least loaded decode actor.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Sequence

from ray.exceptions import RayActorError
from transformers import AutoTokenizer

from cluster.owner.owner import NotAccepted, RequestOwner
from cluster.routing.router import Router
from engine.multimodal.processing import MultimodalProcessor
from llmapi.batch import Prompt, as_prompt_list, split_prompt, wait_all
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.result import RequestOutput
from llmapi.sampling_params import SamplingParams
from protocol import Submit


class ActorRoles:
    """Roles on plain Ray actors: this owner routes each call to the least loaded worker of the role (by the tokens
    it has sent there), skipping workers it has seen die."""

    def __init__(self, prefill: list[Any], decode: list[Any], encoder: list[Any] = ()):
        self.routers = {"prefill": Router(prefill, "prefill"), "decode": Router(decode, "decode")}
        self.encoder_router = Router(list(encoder), "encoder") if encoder else None
        self.colocated = False
        self._dead: set[Any] = set()

    async def encode(self, result: RequestOutput, images: tuple) -> DisaggregatedParams:
        if self.encoder_router is None:
            raise ValueError("this client was given no encoder workers: it takes no images")
        router = self.encoder_router
        try:
            i = router.pick(len(images), exclude=tuple(i for i, w in enumerate(router.workers) if w in self._dead))
        except RuntimeError as exc:  # every encoder worker is dead
            raise NotAccepted(str(exc)) from None
        try:
            return await router.workers[i].encode.remote(list(images))
        except RayActorError:
            self._dead.add(router.workers[i])
            raise
        finally:
            router.release(i, len(images))

    async def call(self, role: str, submit: Submit) -> AsyncIterator:
        if submit.route is not None:
            raise ValueError("plain-actor owners post-process the decode stream themselves (no lanes)")
        cost = len(submit.prompt_token_ids) + (0 if submit.kind == "context_only" else submit.params.max_tokens)
        router = self.routers[role]
        dead = tuple(i for i, w in enumerate(router.workers) if w in self._dead)
        try:
            i = router.pick(cost, exclude=dead)
        except RuntimeError as exc:  # every worker of the role is dead: the owner serves it another way
            raise NotAccepted(str(exc)) from None
        worker = router.workers[i]
        try:
            async for ref in worker.serve.remote(submit):
                yield await ref
        except RayActorError:
            self._dead.add(worker)
            raise
        finally:
            router.release(i, cost)


class DisaggregatedClient:
    """encoder: encoder actors, for a model with a vision tower: prompt dicts with multi_modal_data then work (the
    images are decoded and hashed here, encoded there, read by the prefill actor)."""

    def __init__(self, prefill: list[Any], decode: list[Any], tokenizer_dir: str, request_timeout_s: float = 300.0,
                 encoder: list[Any] = ()):
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.processor = MultimodalProcessor(tokenizer_dir) if encoder else None
        self.owner = RequestOwner(ActorRoles(prefill, decode, encoder), self.tokenizer, request_timeout_s)
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
