"""The prefill role: context-only requests. A Ray actor class (plain Python until Ray wraps it)."""

from __future__ import annotations

from typing import AsyncIterator

from decode.worker import Accepted, DecodeWorker
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.sampling_params import SamplingParams


class PrefillWorker(DecodeWorker):
    """Computes a prompt's KV and first token(s); the blocks wait under a lease for a decode worker to read.

    Its engine can serve whole requests too (the methods of DecodeWorker): the owner's way out when no decode worker
    is up.
    """

    async def prefill(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                      images: DisaggregatedParams | None = None) -> AsyncIterator[Accepted | EngineResponse]:
        """Accepted, then the context-only response: first token per candidate, and a Handoff naming the KV blocks
        unless every candidate ended there. An owner that leaves after the hand-off sends Abort, which ends the
        lease; a call cancelled before the owner got it ends the lease here. images: an encoder's output
        (multimodal_embedding_handles and multimodal_hashes, one per image): the embeddings are read from the
        encoder over NIXL and spliced at the prompt's image positions."""
        yield self._accepted()
        mm = images or DisaggregatedParams()
        context = DisaggregatedParams(request_type="context_only",
                                      multimodal_embedding_handles=mm.multimodal_embedding_handles,
                                      multimodal_hashes=mm.multimodal_hashes)
        last = None
        try:
            async for rsp in self.stream(request_id, prompt_token_ids, params, context):
                last = rsp
            yield last
        except BaseException:
            if last is not None and last.handoff is not None:
                self.abort(request_id)  # nobody will read the KV: free it now, not when the lease ends
            raise
