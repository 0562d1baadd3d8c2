"""OpenAI request bodies (pydantic, validated at the edge) and their translation to SamplingParams."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.edge.tools import Tool, ToolChoice, ToolPlan, check_tools
from llmapi.sampling_params import MAX_LOGIT_BIAS, GuidedDecodingParams, SamplingParams


def bad_text(value, path: str = "body") -> str | None:
    """The path of the first string in a parsed JSON value that is not valid Unicode (a lone surrogate), if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{path}: not valid Unicode (a lone surrogate at character {exc.start})"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = bad_text(item, str(key) if path == "body" else f"{path}.{key}")
        if found:
            return found
    return None


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class JsonSchema(BaseModel):
    name: str = Field("response", description="The schema's name (accepted; not used).")
    description: str | None = None
    schema_: dict = Field(alias="schema", description="A JSON schema the output must validate against.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = Field(None, description="Required with type json_schema.")

    @model_validator(mode="after")
    def _compiles(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({'name': ..., 'schema': {...}})")
        self.guided_decoding()  # a malformed schema is refused here, at the edge
        return self

    def guided_decoding(self) -> GuidedDecodingParams | None:
        if self.type == "text":
            return None
        try:
            if self.type == "json_object":
                return GuidedDecodingParams(json_object=True)
            return GuidedDecodingParams(json=self.json_schema.schema_)
        except Exception as exc:  # noqa: BLE001 - whatever the grammar compiler raises, the schema is what is wrong
            raise ValueError(str(exc).replace("SamplingParams.guided_decoding.json", "json_schema.schema")) from None


class _Sampling(BaseModel):
    """Fields common to completions and chat completions. Unknown fields are ignored, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="The served model's name (see /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 is off.")
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end generation.")
    seed: int | None = Field(None, description="Same seed, same prompt: same tokens.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Extension: keep generating after EOS.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extension: token ids that end generation.")
    cache_salt: str | None = Field(None, min_length=1, description="Extension (vLLM's): prefix-cache entries are "
                                   "shared only between requests with the same salt (tenant isolation).")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted once from each token already in "
                                    "the output.")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted per occurrence of a token in the "
                                     "output.")
    repetition_penalty: float = Field(1.0, gt=0, description="Extension (vLLM's): transformers' repetition penalty "
                                      "over prompt and output tokens; 1 is off.")
    min_p: float = Field(0.0, ge=0, le=1, description="Extension: drop tokens less likely than min_p times the "
                         "most likely one; 0 is off.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100] "
                                                "added to its logit.")
    response_format: ResponseFormat | None = Field(None, description="{'type': 'json_object'} or {'type': "
                                                   "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}.")
    user: str | None = Field(None, description="Accepted and ignored.")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        problem = bad_text(data)
        if problem:  # e.g. a lone surrogate ("\ud800"): no tokenizer can take it
            raise ValueError(problem)
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    def sampling_params(self, max_tokens: int, logprobs: int | None, **extra) -> SamplingParams:
        """max_tokens: the endpoint's choice (chat: max_completion_tokens before max_tokens, else a default)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, cache_salt=self.cache_salt,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            guided_decoding=self.guided_decoding(), **extra,
        )

    def guided_decoding(self) -> GuidedDecodingParams | None:
        return self.response_format.guided_decoding() if self.response_format else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A prompt, a token id list, several prompts, or several token id lists (OpenAI's four forms).")
    max_tokens: int | None = Field(16, ge=0, description="Most tokens to generate per choice; 0 (with echo) "
                                   "generates none: the prompt and, with logprobs, its logprobs (how evaluation "
                                   "harnesses score a text).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Top log-probabilities per token (0-5).")
    echo: bool = Field(False, description="Prepend the prompt to each choice's text (and, with logprobs, the "
                       "prompt tokens' logprobs).")

    @model_validator(mode="after")
    def _nothing_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is only accepted with echo true (the prompt, and "
                             "its logprobs with logprobs set)")
        return self

    @property
    def generates(self) -> bool:
        return self.max_tokens != 0

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if not value or (isinstance(value, list) and isinstance(value[0], (str, list)) and not all(value)):
            raise ValueError("must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(min_length=1, description="data:image/...;base64,... (http(s):// and file:// only where the "
                                               "deployment allows them).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted and ignored.")


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object, got {type(parsed).__name__}")
        return value


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="A tool turn: the call it answers.")

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def template_content(self) -> str | list[dict]:
        """The content as a chat template of an image model takes it: text, or parts with {"type": "image"}."""
        if not isinstance(self.content, list):
            return self.text()
        return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.content]

    def template_message(self, images: bool) -> dict:
        """The message as chat templates take it (transformers'): a call's arguments as a dict, as vLLM gives them."""
        message = {"role": self.role, "content": self.template_content() if images else self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (newer name).")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools), "required" '
                                           'or {"type": "function", "function": {"name": ...}}.')
    parallel_tool_calls: bool = Field(True, description="With tool_choice required: more than one call allowed.")

    @model_validator(mode="after")
    def _tools(self):
        check_tools(self.tools, self.tool_choice, self.response_format is not None and
                    self.response_format.type != "text")
        return self

    def tool_plan(self) -> ToolPlan:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def guided_decoding(self) -> GuidedDecodingParams | None:
        return self.tool_plan().guided_decoding() or super().guided_decoding()

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
