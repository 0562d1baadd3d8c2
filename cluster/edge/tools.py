"""Tool calling in chat completions, as OpenAI's API and vLLM's server define it.

A request's `tools` go to the chat template; its `tool_choice` decides how the reply is produced and read:
"none" (plain text), "auto" (free text, read by the configured parser: Hermes/Qwen `<tool_call>{json}</tool_call>`),
"required" (a grammar forces a JSON list of calls `[{"name": ..., "parameters": {...}}]`) or a named function (a
grammar forces its arguments). `ToolPlan` holds that decision; a `ToolReader` per choice turns the generated text,
whole or streamed, into `Content`, `CallStart` and `Arguments` events, from which both the whole message and the
streamed deltas are built.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmapi.sampling_params import GuidedDecodingParams

TOOL_CALL_PARSERS = ("hermes",)  # the names `tool_call_parser` takes in the YAML


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="The function's name: a-z, A-Z, 0-9, _ and -, "
                                                                     "at most 64 characters.")
    description: str | None = Field(None, description="What the function does (given to the model).")
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}},
                             description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted; required and named calls always follow the schema.")


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, guided: bool) -> None:
    """Raises ValueError naming the field of a tools / tool_choice combination that cannot be served."""
    tools = tools or []
    names = [t.function.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tools: function names must be unique; {repeated} appear more than once")
    for i, tool in enumerate(tools):
        try:
            GuidedDecodingParams(json=tool.function.parameters)
        except ValueError as exc:
            raise ValueError(f"tools.{i}.function.parameters: {exc}") from None
    if choice is not None and choice != "none" and not tools:
        raise ValueError(f"tool_choice: {_choice_name(choice)!r} needs tools; none were given")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools ({names})")
    if guided and choice is not None and (choice == "required" or isinstance(choice, NamedToolChoice)):
        raise ValueError(f"response_format cannot be combined with tool_choice {_choice_name(choice)!r}: both "
                         f"constrain the whole reply")


def _choice_name(choice: ToolChoice) -> str:
    return choice if isinstance(choice, str) else choice.function.name


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: tuple[Tool, ...]
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True  # required: more than one call allowed

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool) -> "ToolPlan":
        """Defaults as OpenAI's: "auto" when tools are given, else "none"."""
        if isinstance(choice, NamedToolChoice):
            return cls(tuple(tools), "named", choice.function.name, parallel)
        return cls(tuple(tools or ()), choice or ("auto" if tools else "none"), None, parallel)

    def template_tools(self) -> list[dict] | None:
        """The tools as a chat template takes them (transformers' `tools` argument)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The grammar of a required or named reply (its JSON is compact: no whitespace between tokens)."""
        if self.mode == "named":
            return GuidedDecodingParams(json=self._function(self.name).parameters)
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return GuidedDecodingParams(json=schema | ({} if self.parallel else {"maxItems": 1}))

    def _function(self, name: str) -> FunctionDef:
        return next(t.function for t in self.tools if t.function.name == name)

    def reader(self, parser: str | None) -> "ToolReader | None":
        """A fresh reader for one choice, or None when the text is the reply as it is."""
        if self.mode == "named":
            return NamedReader(self.name)
        if self.mode == "required":
            return RequiredReader()
        if self.mode == "auto":
            return _PARSERS[parser]() if parser else None
        return None


# ---- events: what a reader finds in the text ----

@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class Arguments:
    index: int
    text: str  # a piece of the call's arguments (JSON text)


Event = Content | CallStart | Arguments


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolReader:
    """Reads one choice's text as it arrives. `feed` returns what the new text completes; `end` what is left."""

    def __init__(self):
        self.calls = 0  # calls found so far

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def end(self) -> list[Event]:
        return []

    def _call(self, name: str, arguments: str) -> list[Event]:
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, _call_id(), name), Arguments(index, arguments)]


class NamedReader(ToolReader):
    """The whole text is the named function's arguments (forced by its grammar): streamed as it comes."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.calls:
            events, self.calls = [CallStart(0, _call_id(), self.name)], 1
        return events + ([Arguments(0, text)] if text else [])


class RequiredReader(ToolReader):
    """The text is a compact JSON list of {"name", "parameters"} objects (forced by the grammar): each call is
    emitted once its object is complete."""

    def __init__(self):
        super().__init__()
        self.buffer = ""
        self.pos = 0  # where the next element (or the list's opening) starts
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            start = self.pos
            while start < len(self.buffer) and self.buffer[start] in "[, \n\t":
                start += 1
            try:
                item, stop = self.decoder.raw_decode(self.buffer, start)
            except ValueError:  # incomplete: wait for more text
                return events
            self.pos = stop
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                events += self._call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))


class HermesReader(ToolReader):
    """Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, with
    text before. Text that could still become a tag is held back; a call whose JSON does not parse stays text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            tag = self.CLOSE if self.inside else self.OPEN
            at = self.buffer.find(tag)
            if at < 0:
                if not self.inside:
                    keep = _partial_suffix(self.buffer, tag)
                    events += self._text(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            body, self.buffer = self.buffer[:at], self.buffer[at + len(tag):]
            events += self._parsed(body) if self.inside else self._text(body)
            self.inside = not self.inside

    def end(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        if self.inside:  # the model stopped before closing the tag: a complete JSON call still counts
            return self._parsed(rest, unclosed=True)
        return self._text(rest)

    def _text(self, text: str) -> list[Event]:
        # between and after calls only real text counts, not the newlines around the tags
        if self.calls and not text.strip():
            return []
        return [Content(text)] if text else []

    def _parsed(self, body: str, unclosed: bool = False) -> list[Event]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return [Content(self.OPEN + body + ("" if unclosed else self.CLOSE))]
        return self._call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a beginning of tag (it may still become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


_PARSERS = {"hermes": HermesReader}
assert tuple(_PARSERS) == TOOL_CALL_PARSERS


# ---- building OpenAI's message and deltas from events ----

def message(events: list[Event]) -> dict:
    """The assistant message of a whole (non-streamed) choice."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = _calls(events)
    body = {"role": "assistant", "content": content or (None if calls else "")}
    return body | ({"tool_calls": calls} if calls else {})


def delta(events: list[Event]) -> dict:
    """The delta of one streamed chunk: its text, and each call it starts or continues (by index)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = _calls(events, streamed=True)
    return ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})


def _calls(events: list[Event], streamed: bool = False) -> list[dict]:
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, Arguments):
            calls.setdefault(e.index, {"function": {"arguments": ""}})["function"]["arguments"] += e.text
    if streamed:
        return [{"index": i} | call for i, call in sorted(calls.items())]
    return [call for _, call in sorted(calls.items())]
