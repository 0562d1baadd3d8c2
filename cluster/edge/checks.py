"""What the edge checks before anything behind it sees a request: body size, text, request limits, and admission.

Every refusal is an EdgeError: a 4xx (429/503 for load) with an OpenAI-style body naming the field or the limit.
"""

from __future__ import annotations

import dataclasses
import json

from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException

from cluster.config import LimitsSettings, RaypdConfig
from cluster.edge.openai_format import error_body
from engine.config import load_spec, run_dtype
from engine.kv.block_manager import request_blocks
from engine.kv.kv_cache import KVLayout
from llmapi.sampling_params import SamplingParams


class EdgeError(Exception):
    """A request the edge refuses; status and OpenAI error body say why."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, kind, param, code), headers


@dataclasses.dataclass(frozen=True)
class EdgeLimits:
    """What a request may ask for, known before any worker sees it."""

    vocab_size: int
    context_length: int
    max_blocks: int
    block_size: int
    max_token_chars: int  # the longest text one token stands for: a longer prompt cannot fit the context
    limits: LimitsSettings
    windows: tuple[int | None, ...] = (None,)  # per KV layer group (engine/kv/kv_cache.py)
    max_chunk: int | None = None  # the engines' per-step token budget

    @classmethod
    def of(cls, config: RaypdConfig, tokenizer) -> "EdgeLimits":
        spec = load_spec(config.model)
        engine = config.engine_config()
        dtype = run_dtype(engine.dtype, spec.checkpoint_dtype, engine.device)
        layout = KVLayout.of(spec, engine.block_size, dtype)
        # Every role's engine may serve a request whole (the owner's way out when the other role is lost): the
        # smallest pool bounds what is admitted.
        roles = ("decode",) if config.mode == "colocated" else ("prefill", "decode")
        max_blocks = min(config.engine_config(role=role).pool_blocks(layout) for role in roles)
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        chunk = max(config.engine_config(role=role).max_num_batched_tokens for role in roles)
        return cls(spec.vocab_size, spec.max_position_embeddings, max_blocks, engine.block_size, max(longest, 1),
                   config.limits, layout.group_windows, chunk)

    def check_text_length(self, text: str, param: str) -> None:
        """Refuses, before tokenizing it, a prompt that cannot fit the context whatever its tokens."""
        if len(text) > self.context_length * self.max_token_chars:
            raise EdgeError(400, f"{param} is {len(text)} characters long: more than the context length "
                                 f"{self.context_length} tokens can hold", param=param, code="context_length_exceeded")

    def check_count(self, count: int, limit: int, what: str, param: str) -> None:
        if count > limit:
            raise EdgeError(400, f"{param}: {count} {what}, at most {limit} per request", param=param)

    def check(self, ids: list[int], params: SamplingParams) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EdgeError(400, f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        total = len(ids) + params.max_tokens
        if total > self.context_length:
            raise EdgeError(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                                 f"the context length {self.context_length}", param="max_tokens",
                            code="context_length_exceeded")
        if request_blocks(len(ids), params.max_tokens, params.num_candidates, self.block_size, self.windows,
                          self.max_chunk) > self.max_blocks:
            raise EdgeError(400, f"the request needs more KV blocks than a worker has ({self.max_blocks})",
                            param="max_tokens")


@dataclasses.dataclass(frozen=True)
class Ticket:
    tokens: int


class Admission:
    """A bounded queue per ingress replica, in requests and in tokens. Over either bound a request is shed at once
    with Retry-After: 429, or 503 while a role is down (degraded); while closed (draining, or no replica of any role)
    every request is refused with 503."""

    def __init__(self, limits: LimitsSettings):
        self.limits = limits
        self.requests = 0
        self.tokens = 0
        self.shed = 0
        self.degraded: str | None = None  # a role is down: the others still serve
        self.closed: str | None = None  # nothing can be served now

    def check_room(self) -> None:
        """The cheap check before any work on the request (parsing aside)."""
        if self.closed is not None:
            self._shed(503, f"the service is unavailable: {self.closed}")
        if self.requests >= self.limits.max_requests_in_flight:
            self._over(f"this server has {self.requests} requests in flight (its limit)")

    def admit(self, tokens: int) -> Ticket:
        self.check_room()
        if self.tokens + tokens > self.limits.max_tokens_in_flight and self.requests:
            self._over(f"this server has {self.tokens} tokens in flight; {tokens} more would pass its limit "
                       f"({self.limits.max_tokens_in_flight})")
        self.requests += 1
        self.tokens += tokens
        return Ticket(tokens)

    def release(self, ticket: Ticket) -> None:
        self.requests -= 1
        self.tokens -= ticket.tokens

    def _over(self, message: str) -> None:
        if self.degraded is not None:
            self._shed(503, f"{message}, and {self.degraded}; retry shortly")
        self._shed(429, f"{message}; retry shortly")

    def _shed(self, status: int, message: str) -> None:
        self.shed += 1
        kind = "rate_limit_error" if status == 429 else "service_unavailable"
        raise EdgeError(status, message, kind, code="overloaded" if status == 429 else "unavailable",
                        headers={"Retry-After": str(self.limits.retry_after_s)})


class EdgeGate:
    """ASGI middleware, the first thing a request meets: a generation request that the app's admission
    (`state.admission`) has no room for is shed before its body is even read, and a body larger than
    `state.max_body_bytes` is refused with 413 before anything parses it (Content-Length first, then by counting
    what arrives). Under a flood this keeps the cost of a refusal, and so of /health, small."""

    def __init__(self, app, default_max_bytes: int = 32 << 20):
        self.app, self.default_max_bytes = app, default_max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        admission = getattr(state, "admission", None)
        if admission is not None and scope.get("method") == "POST" and scope.get("path", "").startswith("/v1/"):
            try:
                admission.check_room()
            except EdgeError as exc:
                return await _answer(send, exc.status, exc.body, exc.headers or {})
        limit = getattr(state, "max_body_bytes", self.default_max_bytes)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _refuse(send, limit)
        seen = 0

        async def counted():
            nonlocal seen
            try:
                message = await receive()
            except TaskCancelledError:  # Serve's word that the client left: ASGI's is a disconnect message, which
                return {"type": "http.disconnect"}  # ends a streaming response quietly instead of failing its task
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge(limit)
            return message

        await self.app(scope, counted, send)


async def _refuse(send, limit: int) -> None:
    await _answer(send, 413, error_body(f"the request body is larger than {limit} bytes", "invalid_request_error",
                                        code="request_too_large"), {})


async def _answer(send, status: int, body: dict, headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class _TooLarge(HTTPException):
    """Raised while the body is read: the app's HTTPException handler turns it into the 413 answer."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")
