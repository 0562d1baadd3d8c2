"""Roles on Ray Serve deployments: Serve picks the replica; each call streams Accepted first, naming the replica's
control pipe, so aborts and stops reach that replica whatever happens to the call. An owner that stops reading a
stream cancels its call (the replica then aborts the request in its engine)."""

from __future__ import annotations

from typing import AsyncIterator

from decode.worker import PostprocRoute
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import Resume
from llmapi.result import RequestOutput


class ServeRoles:
    def __init__(self, prefill, decode, encoder=None):
        self.colocated = prefill is None
        self._handles = {"prefill": prefill, "decode": decode}
        self._encoder = encoder

    async def encode(self, result: RequestOutput, images: tuple) -> DisaggregatedParams:
        if self._encoder is None:
            raise ValueError("this deployment has no encoder role: the model has no vision tower")
        return await self._encoder.encode.remote(list(images))

    def prefill(self, request_id: int, result: RequestOutput, images: DisaggregatedParams | None = None
                ) -> AsyncIterator:
        return self._stream("prefill", "prefill", request_id, result.prompt_token_ids, result.sampling_params,
                            images)

    def generate(self, role: str, request_id: int, result: RequestOutput, params: DisaggregatedParams | None,
                 resume: Resume | None) -> AsyncIterator:
        return self._stream(role, "generate", request_id, result.prompt_token_ids, result.sampling_params, params,
                            resume)

    def generate_via_postproc(self, role: str, request_id: int, result: RequestOutput,
                              params: DisaggregatedParams | None, resume: Resume | None,
                              route: PostprocRoute) -> AsyncIterator:
        return self._stream(role, "generate_via_postproc", request_id, result.prompt_token_ids,
                            result.sampling_params, params, route, resume)

    async def _stream(self, role: str, method: str, *args) -> AsyncIterator:
        # The request router reads the prompt's token ids from args[1] (cluster/request_router.py).
        response = getattr(self._handles[role].options(stream=True), method).remote(*args)
        done = False
        try:
            async for item in response:
                yield item
            done = True
        finally:
            if not done:
                response.cancel()
