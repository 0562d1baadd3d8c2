"""The OpenAI-compatible ingress: validates at the edge, sheds load, owns its requests, streams SSE. A Serve
deployment. /health and /metrics read state kept up to date in the background, so they never wait behind generation;
what /health would answer is also published with the replica's directory entry, for cluster.serving.health.
"""
# No `from __future__ import annotations` here: Serve's ingress wrapper breaks FastAPI's reading of string annotations.

import asyncio
import hmac
from typing import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from cluster.config import RaypdConfig
from cluster.owner.direct import DirectStarts
from cluster.edge.checks import Admission, EdgeError, EdgeGate, EdgeLimits, Ticket
from cluster.edge.images import BadImage, EdgeImages
from cluster.serving.health import health_response
from cluster.serving.nice import apply_nice
from cluster.owner.lanes import OwnerLanes
from cluster.routing.local_prefill import LocalPrefill
from cluster.edge.metrics import Metrics
from cluster.edge.openai_format import Formatter, error_body
from cluster.edge.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.owner.owner import RequestOwner
from cluster.serving.roles import ServeRoles
from cluster.edge.chat_template import ChatTemplate
from cluster.edge.tools import ToolPlan
from cluster.edge.streaming import abort_unfinished, event, failure_events, pieces
from cluster.edge.watch import DirectoryWatch
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams

app = FastAPI(title="raypd", description="OpenAI-compatible endpoints of a disaggregated prefill/decode cluster")
app.add_middleware(EdgeGate)


@app.exception_handler(EdgeError)
async def _edge_error(request: Request, exc: EdgeError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # a model-level check names its field in its message: no "body: " before it
    problems = [(f"{'.'.join(str(p) for p in e['loc'][1:])}: " if e["loc"][1:] else "")
                + e["msg"].removeprefix("Value error, ") for e in errors]
    first = errors[0]["loc"][1:] if errors else ()
    return JSONResponse(error_body("; ".join(problems), "invalid_request_error", ".".join(map(str, first)) or None),
                        status_code=400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, config: RaypdConfig, prefill, decode, api_key: str | None, postprocs: list, encoder=None):
        apply_nice()
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.template = ChatTemplate(self.tokenizer)
        self.limits = EdgeLimits.of(self.config, self.tokenizer)
        # Images are decoded, checked and hashed here, once; only a model with an encoder role takes them.
        self.images = EdgeImages(config.model, config.multimodal) if encoder is not None else None
        self.admission = Admission(config.limits)
        app.state.max_body_bytes = int(config.limits.max_body_bytes)  # read by EdgeGate before any parsing
        app.state.admission = self.admission
        self._local_prefill = LocalPrefill.for_config(config, colocated=prefill is None)  # fed by _watch
        roles = ServeRoles(prefill, decode, encoder, config.router.transport)
        self.owner = RequestOwner(roles, self.tokenizer, self.config.request_timeout_s,
                                  local_prefill=self._local_prefill)
        self._lanes = self._open_lanes(postprocs)
        self.owner.lanes = self._lanes
        if self._lanes is not None and config.router.direct_when_idle:  # direct starts go through the postproc path
            self.owner.direct = DirectStarts(self.owner.control, asyncio.get_event_loop(),
                                             ray.util.get_node_ip_address())
        self.metrics = Metrics()
        roles = [name for name, h in (("prefill", prefill), ("decode", decode)) if h is not None]
        replica = serve.get_replica_context().replica_id
        self._watch = DirectoryWatch(replica.deployment_id.app_name, replica.unique_id, roles, self.admission,
                                     self.owner, self._local_prefill, self.problem)
        self._watch_roles = asyncio.get_event_loop().create_task(self._watch.run())
        self._api_key = api_key

    # ---- endpoints ----
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """This replica's own answer. Deployed with cluster.serving.app.deploy, /health reaches cluster.serving.health
        instead, which answers the same from what every ingress replica publishes, in a process no flood waits in."""
        return health_response(self.problem(), self.config.limits.retry_after_s)

    def problem(self) -> str | None:
        """Why this replica cannot serve now (draining, a role or a postproc worker missing), or None."""
        problems = [p for p in (self.admission.closed or self.admission.degraded,
                                self._lanes.health() if self._lanes else None) if p]
        return "; ".join(problems) or None

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        card = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "raypd",
                "max_model_len": self.limits.context_length}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        for role, stats in self._watch.role_stats.items():
            self.metrics.set_kv(role, stats)
        counters = dict(self.owner.counters, shed=self.admission.shed, in_flight=self.admission.requests,
                        lane_dropped=self._lanes.lane.dropped if self._lanes else 0)
        self.metrics.set_kv("ingress", counters)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._admit_request(request, body.model)
        prompts = body.prompts()
        self.limits.check_count(len(prompts), self.config.limits.max_prompts_per_request, "prompts", "prompt")
        # echo with logprobs: the prompt tokens' logprobs come from the prompt's logits (prompt_logprobs)
        echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        # max_tokens 0 (echo only): one token is generated, as every request has a first token, and not returned
        params = self._params(body, body.max_tokens if body.generates else 1, body.logprobs,
                              prompt_logprobs=echo_logprobs)
        encoded = [(p, await self._encode(p, "prompt")) if isinstance(p, str) else (None, p) for p in prompts]
        fmt = Formatter(False, self.config.model_name, self.tokenizer, body.logprobs or 0, echo=body.echo,
                        generated=body.generates)
        return await self._serve(encoded, params, body, fmt)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._admit_request(request, body.model)
        self.limits.check_count(len(body.messages), self.config.limits.max_messages_per_request, "messages",
                                "messages")
        params = self._params(body, body.max_completion_tokens or body.max_tokens, body.logprob_count())
        parts = [(f"messages[{i}].content[{j}]", p.image_url.url) for i, m in enumerate(body.messages)
                 for j, p in m.image_parts()]
        if parts and self.images is None:
            raise EdgeError(400, f"{parts[0][0]}: model {self.config.model_name!r} is text-only; it takes no images",
                            param=parts[0][0])
        for i, m in enumerate(body.messages):
            self.limits.check_text_length(m.text(), f"messages.{i}.content")
        tools = self._tool_plan(body)
        messages = [m.template_message(images=self.images is not None) for m in body.messages]
        text = await asyncio.to_thread(self.template.render, messages, tools.template_tools())
        ids = await self._encode(text, "messages", add_special_tokens=False)
        images = ()
        if parts:
            try:
                ids, images = await self.images.prepare(ids, parts)
            except BadImage as exc:
                raise EdgeError(400, str(exc), param=exc.param) from None
        fmt = Formatter(True, self.config.model_name, self.tokenizer, body.top_logprobs or 0, tools=tools,
                        tool_parser=self.config.tool_call_parser)
        return await self._serve([(text, ids)], params, body, fmt, [images])

    # ---- the edge ----
    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        """The request's use of tools, refused (400) where this model or server cannot serve it."""
        tools = body.tool_plan()
        if tools.tools and not self.template.takes_tools:
            raise EdgeError(400, f"tools: the chat template of model {self.config.model_name!r} does not render "
                                 f"tools; this model cannot be given any", param="tools")
        if tools.mode == "auto" and self.config.tool_call_parser is None:
            raise EdgeError(400, "tool_choice: \"auto\" needs a tool call parser and this server has none "
                                 "(tool_call_parser in its config); use \"required\" or a named function",
                            param="tool_choice")
        return tools

    def _admit_request(self, request: Request, model: str) -> None:
        self._authorize(request)
        self._check_model(model)
        self.admission.check_room()  # shed at once, before any tokenizing

    async def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.limits.check_text_length(text, param)
        # Off the event loop: a long prompt must not stall every other stream (the tokenizer releases the GIL).
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

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

    def _params(self, body, max_tokens: int | None, logprobs: int | None, **extra) -> SamplingParams:
        default = max(1, self.limits.context_length // 8)
        try:
            params = body.sampling_params(max_tokens or default, logprobs, **extra)
        except ValueError as exc:  # SamplingParams names the field
            raise EdgeError(400, str(exc)) from None
        outside = [t for t in params.logit_bias or {} if t >= self.limits.vocab_size]
        if outside:
            raise EdgeError(400, f"logit_bias: token ids {outside[:5]} are not in the vocabulary (ids 0.."
                                 f"{self.limits.vocab_size - 1})", param="logit_bias")
        return params

    # ---- serving ----
    async def _serve(self, prompts, params: SamplingParams, body, fmt: Formatter, images: list | None = None):
        """images: per prompt, its images (engine.multimodal.processing.ImageItem; the prompt's placeholders
        expanded)."""
        images = images or [()] * len(prompts)
        for (_, ids), imgs in zip(prompts, images):
            self.limits.check(ids, params)
            if self.images is not None and not imgs:
                try:
                    self.images.check_text(ids, "messages" if fmt.chat else "prompt")
                except BadImage as exc:
                    raise EdgeError(400, str(exc), param=exc.param) from None
        ticket = self.admission.admit(sum(len(ids) + params.max_tokens * params.num_candidates for _, ids in prompts))
        try:
            created = [self.owner.create(ids, params, streaming=body.stream, text=text) for text, ids in prompts]
            for (result, record), imgs in zip(created, images):
                asyncio.ensure_future(self.owner.run(result, record, imgs))
        except BaseException:
            self.admission.release(ticket)
            raise
        results = [result for result, _ in created]
        if body.stream:
            return StreamingResponse(self._sse(results, fmt, body.include_usage, ticket),
                                     media_type="text/event-stream")
        try:
            await asyncio.gather(*(r.aresult() for r in results))
        except RequestError as exc:
            raise EdgeError(503, f"generation failed: {exc}", "service_unavailable",
                            headers={"Retry-After": str(self.config.limits.retry_after_s)}) from None
        finally:
            abort_unfinished(results)
            self.admission.release(ticket)
        for r in results:
            self.metrics.observe(r)
        return JSONResponse(fmt.response(results))

    async def _sse(self, results: list[RequestOutput], fmt: Formatter, include_usage: bool,
                   ticket: Ticket) -> AsyncIterator[str]:
        n = results[0].sampling_params.n
        first, ended = [True] * (n * len(results)), set()
        try:
            async for piece in pieces(results):
                index = piece.prompt * n + piece.index
                text, ids, lps = piece.text, piece.token_ids, piece.logprobs
                if first[index]:
                    text, ids, lps = fmt.echoed(results[piece.prompt], text, ids, lps)
                chunk = fmt.chunk(index, text, ids, lps, piece.finish_reason, first[index])
                first[index] = False
                if piece.finish_reason is not None:
                    ended.add(index)
                yield event(chunk)
            if include_usage:
                yield event(fmt.usage_chunk(results))
            for r in results:
                self.metrics.observe(r)
        except RequestError as exc:
            for line in failure_events(results, fmt, f"generation failed: {exc}", ended):
                yield line
        finally:
            abort_unfinished(results)
            self.admission.release(ticket)
        yield "data: [DONE]\n\n"

    # ---- background ----
    def _open_lanes(self, postprocs: list) -> "OwnerLanes | None":
        """This replica's lane: postproc workers push the outputs of its requests there (signed, over tcp); a
        watch follows the workers through restarts."""
        if not postprocs:
            return None
        loop = asyncio.get_event_loop()
        lanes = OwnerLanes(postprocs, self.owner.waits.on_output, loop, ray.util.get_node_ip_address())
        self._watch_lanes = loop.create_task(lanes.watch(self.owner.waits.on_postproc_lost))
        return lanes

    def __del__(self):
        if getattr(self, "_lanes", None) is not None:
            self._lanes.close()
        if getattr(self, "owner", None) is not None and self.owner.direct is not None:
            self.owner.direct.close()
