"""EngineWorker: an engine behind an asyncio API, one response stream per request. Plain Python; the prefill and
decode roles wrap it in Ray actors, and tests drive it without Ray."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import torch

from engine.core.engine import EngineConfig, LLMEngine, nixl_connector
from engine.multimodal.image_inputs import ImageInputs, PreparedPrompt
from engine.kv.kv_connector import EngineCard
from engine.core.latency import LatencyWindow
from engine.core.loop import EngineLoop
from engine.parallel.ranks import RankGroup
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import RequestDelta, Resume
from llmapi.sampling_params import SamplingParams

_ACCEPT_TIMEOUT_S = 60.0


class EngineWorker:
    """An engine of a role that exchanges KV with other engines (NIXL connector)."""

    def __init__(self, model_dir: str, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._streams: dict[int, asyncio.Queue] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._latency = LatencyWindow()  # engine thread only
        engine = LLMEngine(model_dir, config, nixl_connector(config), self._start_ranks(model_dir, config))
        self.loop = EngineLoop(engine, self._on_step, self._fail_all)
        dtype = str(self.loop.engine.model.dtype).removeprefix("torch.")
        self.images = ImageInputs(model_dir, dtype, config.device, config.cluster_key, config.kv_transfer_timeout_s)

    def _start_ranks(self, model_dir: str, config: EngineConfig) -> RankGroup | None:
        """The engine's other tensor-parallel ranks, started by whoever hosts this worker; None: the engine starts
        them as child processes of this one when config asks for more than one."""
        return None

    def card(self) -> EngineCard:
        return self.loop.call(lambda e: e.card())

    def meet(self, card: EngineCard) -> None:
        """Checks compatibility with a peer and connects to it; raises ValueError naming any mismatch."""
        self.loop.call(lambda e: e.meet(card))

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks of the engine's pool."""
        return self.loop.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))

    def stats(self) -> dict[str, float]:
        """KV pool occupancy, prefix-cache counters, leases and bytes read, for metrics."""
        return self.loop.call(lambda e: e.stats())

    def record_routing_stats(self) -> dict[str, int]:
        """Serve asks each replica for this periodically; its request router sends work to the least queued."""
        return {"queued_tokens": self.loop.call(lambda e: e.queued_tokens())}

    def cache_snapshot(self) -> tuple[bytes, dict[str, int]]:
        """The prefix cache's keys (BlockManager.cached_keys) and the load a router weighs, read in one engine call."""
        return self.loop.call(lambda e: (e.block_manager.cached_keys(), _load(e)))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler asks each replica for this; each role's policy weighs its own signals
        (cluster/planning/autoscaling.py): prefill its queued prompt tokens and TTFT, decode its running sequences, KV
        use and TPOT."""
        def read(e: LLMEngine) -> dict[str, float]:
            load, (ttft_ms, tpot_ms) = _load(e), self._latency.means_ms()
            return {"queued_prompt_tokens": load["uncomputed_tokens"], "ttft_ms": ttft_ms,
                    "running_seqs": load["num_running"], "tpot_ms": tpot_ms,
                    "kv_usage": load["kv_blocks_in_use"] / e.block_manager.num_blocks}
        return self.loop.call(read)

    def check_health(self) -> None:
        """Raises if the engine loop has died (Serve then replaces the replica)."""
        self.loop.check_alive()

    def release_kv(self, params: DisaggregatedParams) -> None:
        """Frees a context-only request's blocks on its prefill engine without reading them (over NIXL)."""
        self.loop.post(lambda e: e.release_kv(params))

    def abort(self, request_id: int) -> None:
        self.loop.post(lambda e: e.abort_request(request_id))

    def stop_candidates(self, request_id: int, indices: list[int]) -> None:
        self.loop.post(lambda e: [e.stop_candidate(request_id, i) for i in indices])

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.images.close()

    async def stream(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                     disaggregated_params: DisaggregatedParams | None = None, echo_first_tokens: bool = True,
                     on_accept: Callable[[LLMEngine], None] | None = None, resume: Resume | None = None
                     ) -> AsyncIterator[RequestDelta]:
        """Submits a request and yields its responses until the final one. Raises the engine's ValueError.
        Embedding handles in disaggregated_params are read (over NIXL, checked) before the engine sees the request.
        on_accept runs on the engine thread right after the engine took the request."""
        self._aloop = asyncio.get_running_loop()
        prepared = await self._prepare(prompt_token_ids, disaggregated_params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream

        def add(e: LLMEngine) -> None:
            e.add_request(request_id, prepared.token_ids, params, disaggregated_params, echo_first_tokens,
                          mm_items=prepared.mm_items, mm_embeddings=prepared.mm_embeddings, resume=resume)
            self._latency.accept(request_id)
            if on_accept is not None:
                on_accept(e)
        finished = False
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.loop.submit(add)), _ACCEPT_TIMEOUT_S)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.final
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (or failed): free the request's blocks
                self.abort(request_id)
                self.loop.post(lambda e: self._latency.forget(request_id))

    async def _prepare(self, ids: list[int], params: DisaggregatedParams | None) -> PreparedPrompt:
        """The prompt as the engine takes it: a generation-only one as is (its images come with the KV handle);
        otherwise with the embeddings its handles name, read off the event loop (the reader has its deadline)."""
        if params is not None and params.request_type != "generation_only" and params.multimodal_embedding_handles:
            return await asyncio.to_thread(self.images.from_handles, ids, params.multimodal_embedding_handles,
                                           params.multimodal_hashes)
        return self.prepare_now(ids, params)

    def prepare_now(self, ids: list[int], params: DisaggregatedParams | None) -> PreparedPrompt:
        """The prompt of a request without embeddings to read: a generation-only one as is (its images come with
        the KV handle); a text one checked for image placeholders it has no images for."""
        if params is not None and params.request_type == "generation_only":
            return PreparedPrompt(list(ids))
        return self.images.text(ids)

    # ---- on the engine thread ----
    def _on_step(self, responses: list[RequestDelta]) -> None:
        self._latency.observe(responses)
        self._deliver(responses)

    def _deliver(self, responses: list[RequestDelta]) -> None:
        for rsp in responses:
            stream = self._streams.get(rsp.request_id)
            if stream is not None:
                self._aloop.call_soon_threadsafe(stream.put_nowait, rsp)

    def _fail(self, request_id: int, exc: BaseException) -> None:
        """Ends one request's stream with an error (engine thread)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._aloop.call_soon_threadsafe(stream.put_nowait, exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._aloop.call_soon_threadsafe(stream.put_nowait, RuntimeError(f"the engine failed: {exc!r}"))


def _load(e: LLMEngine) -> dict[str, int]:
    """Work the engine holds, in the units routers and autoscalers weigh."""
    bm, live = e.block_manager, [s for r in e.requests.values() for s in r.seqs if not s.finished]
    return {"queued_tokens": e.queued_tokens(),
            "uncomputed_tokens": sum(s.num_tokens - s.num_computed_tokens for s in live),
            "kv_blocks_in_use": bm.num_blocks - bm.num_free_blocks, "block_size": bm.block_size,
            "num_running": len(e.scheduler.running)}
