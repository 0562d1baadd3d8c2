"""Guided decoding: a per-sequence llguidance matcher that masks the logits to the tokens its grammar allows and
advances with each accepted token. The tokenizer's vocabulary is loaded from the model directory on the first
request that has a grammar (an engine that serves none never pays for it)."""

from __future__ import annotations

import threading

import torch

from llmapi.sampling_params import GuidedDecodingParams

_BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)  # (8,) bit b of a mask byte is token 8 * i + b


class Grammars:
    """Builds matchers for one model's vocabulary (llguidance's tokenizer view, built once: ~1 s)."""

    def __init__(self, model_dir: str, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def matcher(self, params: GuidedDecodingParams) -> "GrammarMatcher":
        """A matcher at the grammar's start; raises ValueError if the grammar does not compile for this vocabulary."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llg_tokenizer(), params.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"SamplingParams.guided_decoding: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                try:
                    hf = AutoTokenizer.from_pretrained(self.model_dir)
                    self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
                except Exception as exc:  # noqa: BLE001 - the request is what cannot be served, not the engine
                    raise ValueError(f"SamplingParams.guided_decoding needs the tokenizer of {self.model_dir} (a "
                                     f"fast tokenizer): {exc}") from None
            return self._tokenizer


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the tokens the grammar allows next (EOS only once the grammar is complete)."""
        raw = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.uint8)  # (ceil(V / 32) * 4,)
        bits = (raw[:, None] & _BITS) != 0  # (bytes, 8)
        return bits.flatten()[: self.vocab_size]

    def accept(self, token: int) -> None:
        """Advances past a token sampled under the mask (or one the prefill side sampled under the same grammar)."""
        self._m.consume_token(token)

    def accept_all(self, tokens: list[int]) -> None:
        if tokens:
            self._m.consume_tokens(tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (or the matcher failed: then nothing can follow either)."""
        return self._m.is_stopped()

    def done_after(self, token: int) -> bool:
        """Whether token would complete the grammar, leaving this matcher where it is."""
        probe = self._m.deep_copy()
        probe.consume_token(token)
        return probe.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()
