"""Tool calling at the edge, without Ray: requests validated, grammars built, replies read whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from cluster.edge import tools
from cluster.edge.chat_template import ChatTemplate
from cluster.edge.openai_protocol import ChatCompletionRequest, CompletionRequest
from raypd.tools.tiny import build_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


def _stream(make, pieces: list[str]) -> list[dict]:
    reader = make()
    deltas = [tools.delta(reader.feed(p)) for p in pieces]
    return deltas + [tools.delta(reader.end())]


def _merged(deltas: list[dict]) -> dict:
    """What a client accumulating OpenAI deltas ends with (the openai SDK's rule: by tool call index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = c.get("id", call["id"])
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c.get("function", {}).get("arguments", "")
    return {"content": content, "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()]}


def _whole(make, text: str) -> dict:
    reader = make()
    msg = tools.message(reader.feed(text) + reader.end())
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    return {"content": msg["content"] or "", "calls": calls}


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_are_the_same_whole_and_streamed_in_any_pieces(size):
    pieces = [HERMES[i:i + size] for i in range(0, len(HERMES), size)]
    expected = {"content": "Let me look.\n", "calls": [("get_weather", {"city": "Paris", "days": 2}),
                                                      ("get_time", {})]}
    assert _whole(tools.HermesReader, HERMES) == expected
    deltas = _stream(tools.HermesReader, pieces)
    assert _merged(deltas) == expected
    assert not any("<tool" in d.get("content", "") for d in deltas)  # a tag is never streamed as text
    ids = [c["id"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert len(ids) == len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("text, content, calls", [
    ("no calls at all", "no calls at all", []),
    ("a < b and <tool", "a < b and <tool", []),  # a held-back partial tag is text at the end
    ('<tool_call>{"name": "x", "arguments": ', '<tool_call>{"name": "x", "arguments": ', []),  # cut off
    ('<tool_call>not json</tool_call> after', "<tool_call>not json</tool_call> after", []),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", [("get_time", {})]),  # stopped before the tag
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and then', " and then", [("f", {})]),
])
def test_hermes_text_that_is_not_a_call_stays_text(text, content, calls):
    assert _whole(tools.HermesReader, text) == {"content": content, "calls": calls}


def test_required_reader_emits_each_call_when_its_object_closes():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    reader = tools.RequiredReader()
    assert reader.feed(text[:50]) == []  # inside the first object
    first = reader.feed(text[50:60])
    assert [type(e) for e in first] == [tools.CallStart, tools.Arguments]
    assert reader.feed(text[60:70]) == []
    assert _merged(_stream(tools.RequiredReader, [text[:50], text[50:]]))["calls"] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_named_reader_streams_the_arguments_as_they_come():
    deltas = _stream(lambda: tools.NamedReader("get_weather"), ['{"ci', 'ty":"Rome"}'])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": 'ty":"Rome"}'}}]
    assert _merged(deltas) == {"content": "", "calls": [("get_weather", {"city": "Rome"})]}


def test_plans_grammars_follow_the_tool_choice():
    assert _request(tools=[WEATHER]).tool_plan().mode == "auto"
    assert _request().tool_plan().mode == "none" and _request().guided_decoding() is None
    assert _request(tools=[WEATHER], tool_choice="auto").guided_decoding() is None
    named = _request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.guided_decoding().json) == WEATHER["function"]["parameters"]
    required = json.loads(_request(tools=[WEATHER, TIME], tool_choice="required").guided_decoding().json)
    good = [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = json.loads(_request(tools=[WEATHER, TIME], tool_choice="required",
                                 parallel_tool_calls=False).guided_decoding().json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


@pytest.mark.parametrize("kwargs, names", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[WEATHER, WEATHER]), "unique"),
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
])
def test_bad_tools_are_refused_naming_the_field(kwargs, names):
    with pytest.raises(ValidationError, match=names.replace(".", r"\.")):
        _request(**kwargs)


def test_messages_with_calls_and_results_render_through_the_template():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER])
    template = ChatTemplate(build_tokenizer(512))
    text = template.render([m.template_message(images=False) for m in body.messages], body.tool_plan().template_tools())
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text  # the call
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|assistant|>\n")
    assert template.takes_tools and not ChatTemplate(build_tokenizer(512, image_token=True)).takes_tools
    for bad, field in ((dict(role="assistant", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{x"}}]),
                        "arguments"), (dict(role="tool", content="x"), "tool_call_id"), (dict(role="user"), "content")):
        with pytest.raises(ValidationError, match=field):
            ChatCompletionRequest(model="m", messages=[bad])


def test_max_tokens_zero_is_for_echo_only():
    assert not CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True).generates
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest(model="m", prompt="x", max_tokens=0)
