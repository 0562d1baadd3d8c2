"""Roles on Ray Serve deployments: Serve picks the replica; an abort cancels the request's in-flight call, and the
replica's cancellation path aborts it in the engine (its blocks are freed)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from decode.worker import PostprocRoute
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse
from llmapi.result import RequestOutput


class ServeRoles:
    def __init__(self, prefill, decode, encoder=None):
        self.colocated = prefill is None
        self._prefill = prefill
        self._encoder = encoder
        self._decode = decode.options(stream=True)
        self._decode_call = decode
        self._inflight: dict[int, Any] = {}  # request id -> its DeploymentResponse(Generator)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def encode(self, result: RequestOutput, images: tuple) -> DisaggregatedParams:
        if self._encoder is None:
            raise ValueError("this deployment has no encoder role: the model has no vision tower")
        self._loop = asyncio.get_running_loop()
        response = self._encoder.encode.remote(list(images))
        self._inflight[result.request_id] = response
        try:
            return await response
        finally:
            self._inflight.pop(result.request_id, None)

    async def prefill(self, result: RequestOutput, images: DisaggregatedParams | None = None) -> EngineResponse:
        self._loop = asyncio.get_running_loop()
        response = self._prefill.prefill.remote(result.request_id, result.prompt_token_ids, result.sampling_params,
                                                images)
        self._inflight[result.request_id] = response
        try:
            return await response
        finally:
            self._inflight.pop(result.request_id, None)

    async def decode(self, result: RequestOutput, params: DisaggregatedParams | None) -> AsyncIterator[EngineResponse]:
        self._loop = asyncio.get_running_loop()
        stream = self._decode.generate.remote(result.request_id, result.prompt_token_ids, result.sampling_params,
                                              params)
        self._inflight[result.request_id] = stream
        try:
            async for rsp in stream:
                yield rsp
        finally:
            self._inflight.pop(result.request_id, None)

    async def decode_via_postproc(self, result: RequestOutput, params: DisaggregatedParams | None,
                                  lanes: tuple[int, ...]) -> None:
        self._loop = asyncio.get_running_loop()
        route = PostprocRoute(lanes, result.streaming)
        response = self._decode_call.generate_via_postproc.remote(
            result.request_id, result.prompt_token_ids, result.sampling_params, params, route)
        self._inflight[result.request_id] = response
        try:
            await response
        except asyncio.CancelledError:  # the owner is done with it (stop string, abort): stop the engine too
            response.cancel()
            raise
        finally:
            self._inflight.pop(result.request_id, None)

    def release(self, params: DisaggregatedParams) -> None:
        # Any decode replica can tell the prefill engine over NIXL; Serve gives no handle on the prefill replica.
        self._decode_call.release_kv.remote(params)

    def stop(self, request_id: int, indices: list[int], finished: bool) -> None:
        # Serve gives no handle on the replica itself: stop the whole request once post-processing has ended it;
        # until then a stopped candidate's extra tokens are dropped by the owner's record.
        if finished:
            self.abort(request_id)

    def abort(self, request_id: int) -> None:
        response = self._inflight.get(request_id)
        if response is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(response.cancel)
