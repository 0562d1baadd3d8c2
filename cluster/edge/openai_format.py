"""OpenAI response bodies: whole completions, streamed chunks, usage, logprobs, errors."""

from __future__ import annotations

import math
import time
import uuid

from cluster.edge import tools as tool_events
from cluster.edge.tools import ToolPlan, ToolReader
from llmapi.outputs import CompletionOutput, TokenLogprobs
from llmapi.result import GenerationResult


class Formatter:
    """Builds the JSON of one response (one id, one creation time) for completions or chat."""

    def __init__(self, chat: bool, model: str, tokenizer, num_logprobs: int = 0, echo: bool = False,
                 generated: bool = True, tools: ToolPlan | None = None, tool_parser: str | None = None):
        self.chat = chat
        self.echo = echo  # completions: each choice starts with the prompt (its text, tokens and logprobs)
        self.generated = generated  # False: max_tokens 0 with echo; the one token generated is not returned
        self.tools, self.tool_parser = tools, tool_parser
        self._readers: dict[int, ToolReader | None] = {}  # chat with tools: per choice index, its text's reader
        self.num_logprobs = num_logprobs  # top alternatives asked for per position
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, results: list[GenerationResult]) -> dict:
        # choice index = prompt index * n + candidate index, as OpenAI numbers a batch of prompts
        outputs = [(result, out) for result in results for out in result.outputs]
        body = self._envelope([self._choice(i, r, out) for i, (r, out) in enumerate(outputs)], chunk=False)
        body["usage"] = usage(results, self.generated)
        return body

    def _choice(self, index: int, result: GenerationResult, out: CompletionOutput) -> dict:
        text, token_ids, entries = self.echoed(result, out.text, out.token_ids, out.logprobs)
        logprobs = self.logprobs(token_ids, entries) if entries is not None else None
        choice = {"index": index, "logprobs": logprobs, "finish_reason": out.finish_reason}
        reader = self._reader(index)
        if reader is not None:
            events = reader.feed(text) + reader.end()
            choice["message"] = tool_events.message(events)
            choice["finish_reason"] = self._finish_reason(reader, out.finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def echoed(self, result: GenerationResult, text: str, token_ids: list[int], logprobs: list | None):
        """(text, token ids, logprobs) of a choice, or of its first streamed chunk: with echo, the prompt's first
        (its first token has no logprob: None, as OpenAI reports it)."""
        text, token_ids, logprobs = self._generated(text, token_ids, logprobs)
        if not self.echo:
            return text, token_ids, logprobs
        ids = list(result.prompt_token_ids)
        prompt = result.prompt if result.prompt is not None else self.tokenizer.decode(ids)
        if logprobs is not None:
            logprobs = list(result.prompt_logprobs or [None] * len(ids)) + list(logprobs)
        return prompt + text, ids + list(token_ids), logprobs

    def _generated(self, text: str, token_ids: list[int], logprobs: list | None):
        """What of the output is returned: all of it, or nothing (max_tokens 0 with echo: the one token generated is
        dropped)."""
        if self.generated:
            return text, token_ids, logprobs
        return "", [], [] if logprobs is not None else None

    def chunk(self, index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
              finish_reason: str | None, first: bool) -> dict:
        if not first:  # the first chunk went through echoed()
            text, token_ids, logprobs = self._generated(text, token_ids, logprobs)
        lp = self.logprobs(token_ids, logprobs) if logprobs is not None else None
        choice = {"index": index, "logprobs": lp, "finish_reason": finish_reason}
        reader = self._reader(index)
        if reader is not None:
            events = reader.feed(text) + (reader.end() if finish_reason is not None else [])
            choice["delta"] = ({"role": "assistant"} if first else {}) | tool_events.delta(events)
            choice["finish_reason"] = self._finish_reason(reader, finish_reason)
        elif self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return self._envelope([choice], chunk=True)

    def _reader(self, index: int) -> ToolReader | None:
        if self.tools is None:
            return None
        if index not in self._readers:
            self._readers[index] = self.tools.reader(self.tool_parser)
        return self._readers[index]

    @staticmethod
    def _finish_reason(reader: ToolReader, reason: str | None) -> str | None:
        """OpenAI's: a reply that ended by itself with calls in it ends for "tool_calls"."""
        return "tool_calls" if reason == "stop" and reader.calls else reason

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(results, self.generated)
        return body

    def logprobs(self, token_ids: list[int], entries: list[TokenLogprobs]) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(t, e) for t, e in zip(token_ids, entries)]}
        tokens = [self._text(t) for t in token_ids]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e[t].logprob) if e else None for t, e in zip(token_ids, entries)],
            "top_logprobs": [{self._text(k): _finite(v.logprob) for k, v in self._top(e)} if e else None
                             for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprob(self, token: int, entry: TokenLogprobs) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": _finite(entry[token].logprob), "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._text(k), "logprob": _finite(v.logprob),
                                  "bytes": list(self._text(k).encode())} for k, v in self._top(entry)]}

    def _top(self, entry: TokenLogprobs) -> list:
        """The asked-for alternatives, most likely first (the entry also holds the chosen token, whatever its rank)."""
        return sorted(((k, v) for k, v in entry.items() if v.rank <= self.num_logprobs), key=lambda kv: kv[1].rank)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])


_LOGPROB_FLOOR = -9999.0  # what OpenAI-compatible servers report for a token of probability 0


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the sampler could never pick gets the floor value."""
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def usage(results: list[GenerationResult], generated: bool = True) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(o.token_ids) for r in results for o in r.outputs) if generated else 0
    cached = sum(r.num_cached_tokens or 0 for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
