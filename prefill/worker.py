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

    async def prefill(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams
                      ) -> AsyncIterator[Accepted | EngineResponse]:
        """Accepted, then the context-only response: first token per candidate, and a Handoff naming the KV blocks
        unless every candidate ended there. An owner that leaves after the hand-off sends Abort, which ends the
        lease; a call cancelled before the owner got it ends the lease here."""
        yield Accepted(self._control.addr)
        last = None
        try:
            async for rsp in self.stream(request_id, prompt_token_ids, params,
                                         DisaggregatedParams(request_type="context_only")):
                last = rsp
            yield last
        except BaseException:
            if last is not None and last.handoff is not None:
                self.abort(request_id)  # nobody will read the KV: free it now, not when the lease ends
            raise
