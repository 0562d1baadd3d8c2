"""The decode role: generation-only requests. A Ray actor class (plain Python until ray.remote wraps it)."""

from __future__ import annotations

from typing import AsyncIterator

import ray

from engine.engine import EngineConfig
from engine.worker import EngineWorker
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.sampling_params import SamplingParams


class DecodeWorker(EngineWorker):
    """Reads each request's prompt KV from its prefill worker over NIXL, then decodes with continuous batching."""

    def __init__(self, model_dir: str, config: EngineConfig):
        super().__init__(model_dir, config)
        self.card()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def generate(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                       disaggregated_params: DisaggregatedParams) -> AsyncIterator[EngineResponse]:
        """Streams the request's responses; the first tokens are not repeated (the owner has them from prefill)."""
        if disaggregated_params.request_type != "generation_only":
            raise ValueError(f"a decode worker takes generation_only requests, got {disaggregated_params.request_type!r}")
        async for rsp in self.stream(request_id, prompt_token_ids, params, disaggregated_params,
                                     echo_first_tokens=False):
            yield rsp
