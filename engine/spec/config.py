"""SpeculativeConfig: how an engine drafts tokens for its decoding sequences (vLLM's speculative_config)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method ngram: drafts are what followed the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) earlier in its tokens. method draft_model: a smaller checkpoint (`model`, same vocabulary)
    drafts them, one forward per draft token, with a KV pool of its own holding as many tokens as the engine's.
    disable_by_batch_size: no drafts while more sequences than this run (a large batch is no longer bound by reading
    the weights: verifying drafts then costs more than it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft checkpoint's directory
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculation needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative `model` (the draft checkpoint) is what method draft_model needs, and only it")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
