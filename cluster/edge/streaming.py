"""Server-sent events for one HTTP request: the pieces of its results as they arrive, and how a stream ends."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator

from cluster.edge.openai_format import Formatter, error_body
from llmapi.result import RequestOutput


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one choice got in one streaming step (copied out: the result moves on at its next step)."""

    prompt: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


async def pieces(results: list[RequestOutput]) -> AsyncIterator[Piece]:
    """The pieces of several streaming results, in the order their steps arrive."""
    if len(results) == 1:  # most requests: no pump task and queue hop per token
        async for piece in _pieces_of(0, results[0]):
            yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, result: RequestOutput) -> None:
        try:
            async for piece in _pieces_of(i, result):
                await queue.put(piece)
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


async def _pieces_of(prompt: int, result: RequestOutput) -> AsyncIterator[Piece]:
    """One result's pieces, step by step: what each choice got (a choice's end once). Steps that queued while the
    consumer was busy come as one piece."""
    ended: set[int] = set()
    async for step in result:
        step.catch_up()
        for out in step.outputs:
            ends = out.finished and out.index not in ended
            if out.text_diff or out.token_ids_diff or ends:
                ended.update([out.index] if ends else [])
                lps = list(out.logprobs_diff) if out.logprobs is not None else None
                yield Piece(prompt, out.index, out.text_diff, list(out.token_ids_diff), lps,
                            out.finish_reason if ends else None)


def event(body: dict) -> str:
    # allow_nan=False: a bare NaN is not JSON, and no client should ever have to parse one
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def failure_events(results: list[RequestOutput], fmt: Formatter, message: str, ended: set[int]) -> list[str]:
    """How a failed stream ends: a finish_reason "error" chunk for every choice still open, then the error."""
    n = results[0].sampling_params.n
    chunks = [event(fmt.chunk(i, "", [], None, "error", False)) for i in range(n * len(results)) if i not in ended]
    return chunks + [event(error_body(message, "server_error"))]


def abort_unfinished(results: list[RequestOutput]) -> None:
    # A client that went away (or a failed sibling) must not leave work, or KV blocks, behind.
    for r in results:
        if not r.finished:
            r.abort()
