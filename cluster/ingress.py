"""The OpenAI-compatible ingress: validates at the edge, owns its requests, streams SSE. A Serve deployment."""


import asyncio
import dataclasses
import hmac
import json
from typing import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from cluster.config import RaypdConfig
from cluster.directory import Directory
from cluster.local_prefill import LocalPrefill
from cluster.metrics import Metrics
from cluster.openai_format import Formatter, error_body
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.owner import RequestOwner
from cluster.serve_roles import ServeRoles
from engine.config import load_spec
from engine.kv_cache import KVLayout
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams
from postproc.routing import Lane

app = FastAPI(title="raypd", description="OpenAI-compatible endpoints of a disaggregated prefill/decode cluster")
_HEALTH_TIMEOUT_S = 10.0


class EdgeError(Exception):
    """A request the edge refuses; status and OpenAI error body say why."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


@app.exception_handler(EdgeError)
async def _edge_error(request: Request, exc: EdgeError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
    first = exc.errors()[0]["loc"][1:] if exc.errors() else ()
    return JSONResponse(error_body("; ".join(problems), "invalid_request_error", ".".join(map(str, first)) or None),
                        status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


@dataclasses.dataclass(frozen=True)
class EdgeLimits:
    """What a request may ask for, known before any worker sees it."""

    vocab_size: int
    context_length: int
    max_blocks: int
    block_size: int

    @classmethod
    def of(cls, config: RaypdConfig) -> "EdgeLimits":
        spec = load_spec(config.model)
        engine = config.engine_config()
        dtype = engine.dtype or spec.checkpoint_dtype
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, engine.block_size, dtype)
        return cls(spec.vocab_size, spec.max_position_embeddings, engine.pool_blocks(layout), engine.block_size)

    def check(self, ids: list[int], params: SamplingParams) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EdgeError(400, f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        total = len(ids) + params.max_tokens
        if total > self.context_length:
            raise EdgeError(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                                 f"the context length {self.context_length}", param="max_tokens",
                            code="context_length_exceeded")
        if -(-total // self.block_size) * params.num_candidates > self.max_blocks:
            raise EdgeError(400, f"the request needs more KV blocks than a worker has ({self.max_blocks})",
                            param="max_tokens")


@dataclasses.dataclass(frozen=True)
class _Piece:
    """What one choice got in one streaming step (copied out: the result moves on at its next step)."""

    prompt: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


async def _pieces(results: list[RequestOutput]) -> AsyncIterator[_Piece]:
    """The pieces of several streaming results, in the order their steps arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, result: RequestOutput) -> None:
        ended: set[int] = set()
        try:
            async for step in result:
                for out in step.outputs:
                    ends = out.finished and out.index not in ended
                    if out.text_diff or out.token_ids_diff or ends:
                        ended.update([out.index] if ends else [])
                        lps = list(out.logprobs_diff) if out.logprobs is not None else None
                        await queue.put(_Piece(i, out.index, out.text_diff, list(out.token_ids_diff), lps,
                                               out.finish_reason if ends else None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
        await queue.put(None)

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(results)]
    open_streams = len(results)
    try:
        while open_streams:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                open_streams -= 1
                continue
            yield item
    finally:
        for p in pumps:
            p.cancel()


def _abort_unfinished(results: list[RequestOutput]) -> None:
    # A client that went away (or a failed sibling) must not leave work, or KV blocks, behind.
    for r in results:
        if not r.finished:
            r.abort()


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, config: RaypdConfig, prefill, decode, api_key: str | None, postprocs: list):
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.limits = EdgeLimits.of(self.config)
        self._lane, lanes = self._open_lane(postprocs)
        self.owner = RequestOwner(ServeRoles(prefill, decode), self.tokenizer, self.config.request_timeout_s, lanes,
                                  LocalPrefill.for_config(self.config, colocated=prefill is None))
        self.metrics = Metrics()
        self._roles = {name: h for name, h in (("prefill", prefill), ("decode", decode)) if h is not None}
        self._directory = Directory(serve.get_replica_context().replica_id.deployment_id.app_name)
        self._api_key = api_key

    # ---- endpoints ----
    @app.get("/health")
    async def health(self) -> JSONResponse:
        for role, handle in self._roles.items():
            try:
                await asyncio.wait_for(handle.check_health.remote(), _HEALTH_TIMEOUT_S)
            except Exception as exc:  # no live replica, or a replica whose engine died
                return JSONResponse(error_body(f"{role} role is not healthy: {exc}", "service_unavailable"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        card = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "raypd",
                "max_model_len": self.limits.context_length}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        # Each role's stats summed over its replicas, from the replica directory: never waits behind generation.
        for role in self._roles:
            try:
                self.metrics.set_kv(role, await asyncio.to_thread(self._directory.totals, role))
            except Exception:  # metrics must not fail because the directory is briefly unreachable
                pass
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        params = self._params(body, body.max_tokens, body.logprobs)
        prompts = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, p) for p in body.prompts()]
        fmt = Formatter(False, self.config.model_name, self.tokenizer, body.logprobs or 0)
        return await self._serve(prompts, params, body, fmt)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        params = self._params(body, body.max_completion_tokens or body.max_tokens, body.logprob_count())
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        fmt = Formatter(True, self.config.model_name, self.tokenizer, body.top_logprobs or 0)
        return await self._serve([(text, ids)], params, body, fmt)

    # ---- helpers ----
    def _open_lane(self, postprocs: list) -> tuple[Lane | None, tuple[int, ...]]:
        """This replica's lane: postproc workers push the outputs of its requests there (signed, over tcp)."""
        if not postprocs:
            return None, ()
        loop = asyncio.get_event_loop()
        lane = Lane(lambda out: loop.call_soon_threadsafe(self.owner.on_output, out),
                    host=ray.util.get_node_ip_address())
        return lane, tuple(ray.get([p.add_lane.remote(lane.addr) for p in postprocs], timeout=_HEALTH_TIMEOUT_S * 6))

    def __del__(self):
        if getattr(self, "_lane", None) is not None:
            self._lane.close()

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._api_key}".encode()):
            raise EdgeError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                            code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise EdgeError(404, f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                            "not_found_error", "model", "model_not_found")

    def _params(self, body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        default = max(1, self.limits.context_length // 8)
        try:
            return body.sampling_params(max_tokens or default, logprobs)
        except ValueError as exc:  # SamplingParams names the field
            raise EdgeError(400, str(exc)) from None

    async def _serve(self, prompts, params: SamplingParams, body, fmt: Formatter):
        for _, ids in prompts:
            self.limits.check(ids, params)
        created = [self.owner.create(ids, params, streaming=body.stream, text=text) for text, ids in prompts]
        tasks = [asyncio.ensure_future(self.owner.run(result, record)) for result, record in created]
        results = [result for result, _ in created]
        if body.stream:
            return StreamingResponse(self._sse(results, tasks, fmt, body.include_usage),
                                     media_type="text/event-stream")
        try:
            await asyncio.gather(*(r.aresult() for r in results))
        except RequestError as exc:
            raise EdgeError(500, f"generation failed: {exc}", "server_error") from None
        finally:
            _abort_unfinished(results)
        for r in results:
            self.metrics.observe(r)
        return JSONResponse(fmt.response(results))

    async def _sse(self, results: list[RequestOutput], tasks, fmt: Formatter, include_usage: bool) -> AsyncIterator[str]:
        n = results[0].sampling_params.n
        first = [True] * (n * len(results))
        try:
            async for piece in _pieces(results):
                index = piece.prompt * n + piece.index
                chunk = fmt.chunk(index, piece.text, piece.token_ids, piece.logprobs, piece.finish_reason, first[index])
                first[index] = False
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                yield f"data: {json.dumps(fmt.usage_chunk(results))}\n\n"
            for r in results:
                self.metrics.observe(r)
        except RequestError as exc:
            yield f"data: {json.dumps(error_body(f'generation failed: {exc}', 'server_error'))}\n\n"
        finally:
            _abort_unfinished(results)
        yield "data: [DONE]\n\n"
