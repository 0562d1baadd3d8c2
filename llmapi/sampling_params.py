"""SamplingParams: what a caller asks of one request. Plain types only; imports nothing of the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value


@dataclass(frozen=True)
class GuidedDecodingParams:
    """A grammar the output must follow (TensorRT-LLM's name): exactly one of `json` (a JSON schema, as a dict or
    its JSON text), `json_object` (any JSON object) or `regex`. Grammars are compiled by llguidance; a malformed one
    raises ValueError here, before the request reaches an engine.

    JSON is compact (no whitespace between tokens): small models otherwise loop on whitespace."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "json_object", "regex") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.guided_decoding needs exactly one of json, json_object, regex; got "
                             f"{given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        problem = _grammar_problem(self.grammar())
        if problem:
            raise ValueError(f"SamplingParams.guided_decoding.{given[0]} is not a valid grammar: {problem}")

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint."""
        from llguidance import LLMatcher

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        schema = self.json if self.json is not None else '{"type": "object"}'
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def _schema_text(schema) -> str:
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError as exc:
        raise ValueError(f"SamplingParams.guided_decoding.json is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("SamplingParams.guided_decoding.json must be a JSON schema object, got "
                         f"{type(parsed).__name__}")
    return json.dumps(parsed, sort_keys=True)


def _grammar_problem(grammar: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar).strip()


@dataclass
class SamplingParams:
    """Per-request generation parameters; invalid values raise ValueError naming the field.

    temperature=0 (or below 1e-5) means greedy. `seed` makes sampling reproducible: each draw is derived from
    (seed, candidate index, position), so the result does not depend on the batch or on the worker.
    `best_of` candidates are generated and the `n` with the highest cumulative logprob are returned.
    `logprobs=k` returns the sampled token's logprob plus the top-k alternatives (with ranks) per position;
    `prompt_logprobs=k` does the same for prompt positions.

    Logits are processed in this order: logit_bias (token id -> added bias), repetition_penalty (transformers'
    RepetitionPenaltyLogitsProcessor over prompt and output tokens), frequency/presence penalties (OpenAI's, over
    output tokens), then the guided_decoding grammar's mask; sampling then applies temperature, top_k, top_p and
    min_p (transformers' MinPLogitsWarper). Returned logprobs are of the distribution after the penalties, the bias
    and temperature, before the grammar's mask and the top-k/top-p/min-p truncation.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests with the same salt
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one; 0 is off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self._validate_processing()

    def _validate(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None", self.seed)
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(
            self.best_of is None or (isinstance(self.best_of, int) and self.best_of >= self.n),
            "best_of", f"None or an integer >= n ({self.n})", self.best_of,
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "non-negative integers", self.stop_token_ids,
        )
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt), "cache_salt",
               "None or a non-empty string", self.cache_salt)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, "None or 0..20", value)

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               "a number > 0 (1 is off)", self.repetition_penalty)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        bias = self.logit_bias or {}
        _check(isinstance(bias, dict), "logit_bias", "a dict of token id -> bias", bias)
        for token, value in bias.items():
            _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias",
                   "keyed by non-negative token ids", token)
            _check(_is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS, f"logit_bias[{token}]",
                   f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", value)
        _check(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
               "guided_decoding", "None or a GuidedDecodingParams", self.guided_decoding)

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (the common path skips all of it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.guided_decoding)

    @property
    def num_candidates(self) -> int:
        """How many sequences the engine generates (best_of, or n)."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        """temperature 0, or so close to it that dividing the logits by it would overflow (vLLM's rule too)."""
        return self.temperature < GREEDY_BELOW


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, value) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
