"""The prefill role: context-only requests. A Ray actor class (plain Python until ray.remote wraps it)."""

from __future__ import annotations

import ray

from engine.engine import EngineConfig
from engine.worker import EngineWorker
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.sampling_params import SamplingParams


class PrefillWorker(EngineWorker):
    """Computes a prompt's KV and first token(s); the blocks wait under a lease for a decode worker to read."""

    def __init__(self, model_dir: str, config: EngineConfig):
        super().__init__(model_dir, config)
        self.card()  # start the KV plane now: the first request should not pay for it

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def prefill(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                      images: DisaggregatedParams | None = None) -> EngineResponse:
        """The context-only response: first token per candidate, and DisaggregatedParams naming the KV blocks.
        images: an encoder's output (multimodal_embedding_handles and multimodal_hashes, one per image): the
        embeddings are read from the encoder over NIXL and spliced at the prompt's image positions."""
        mm = images or DisaggregatedParams()
        context = DisaggregatedParams(request_type="context_only",
                                      multimodal_embedding_handles=mm.multimodal_embedding_handles,
                                      multimodal_hashes=mm.multimodal_hashes)
        last = None
        async for rsp in self.stream(request_id, prompt_token_ids, params, context):
            last = rsp
        return last
