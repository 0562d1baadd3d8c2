"""SamplingParams: what a caller asks of one request. Plain types only; imports nothing of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass
class SamplingParams:
    """Per-request generation parameters; invalid values raise ValueError naming the field.

    temperature=0 (or below 1e-5) means greedy. `seed` makes sampling reproducible: each draw is derived from
    (seed, candidate index, position), so the result does not depend on the batch or on the worker.
    `best_of` candidates are generated and the `n` with the highest cumulative logprob are returned.
    `logprobs=k` returns the sampled token's logprob plus the top-k alternatives (with ranks) per position;
    `prompt_logprobs=k` does the same for prompt positions.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

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
