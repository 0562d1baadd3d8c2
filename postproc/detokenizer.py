"""Incremental detokenization and stop strings, one instance per candidate sequence.

Runs wherever token ids become text: the embedded LLM's engine thread (no postproc workers), the postproc workers, and
the cluster's owner for tokens that come straight from an engine; the target is >= 100k tokens/s per worker. For
byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, our tiny models) the per-token path is a table lookup plus Python's
incremental UTF-8 decoder, and it is exact: the concatenated diffs equal ``tokenizer.decode(generated_ids)``.
Re-decoding a window of ids through the Rust tokenizer per token (what ``tokenizers.decoders.DecodeStream`` and vLLM
do) is exact too, but costs two FFI decodes per token; it remains the fallback for every other decoder (Metaspace /
SentencePiece).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence

from tokenizers import decoders

_REPLACEMENT = "\ufffd"

# Tokens of the prompt re-decoded with the first generated ones on the fallback path, so that decoders which strip
# or merge at the start of a text (Metaspace) see the prompt's context, as in vLLM.
_PROMPT_CONTEXT_TOKENS = 5


def _byte_level_translation() -> dict[int, int]:
    """A str.translate table from GPT-2's byte-level alphabet to latin-1 chars (one per byte).

    Every other char below 256 maps to 256 and chars above 255 stay, so latin-1 encoding fails exactly for the tokens
    that the ByteLevel decoder passes through as UTF-8 (a char outside its alphabet).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: b for b in range(256)}  # printable bytes stand for themselves
    shifted = [b for b in range(256) if b not in printable]
    table.update({b: 256 for b in shifted})
    table.update({256 + n: b for n, b in enumerate(shifted)})
    return table


def _backend(tokenizer):
    """The raw ``tokenizers.Tokenizer`` of a transformers tokenizer (or the raw one itself)."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None) or tokenizer


def _cleans_up_spaces(tokenizer) -> bool:
    # transformers 5 applies clean_up_tokenization only to non-BPE models; it rewrites text across token
    # boundaries, so a tokenizer that uses it cannot take the per-token byte path.
    backend = _backend(tokenizer)
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and type(backend.model).__name__ != "BPE"


class TokenTable:
    """What incremental decoding needs from one tokenizer, built once and shared by all its requests.

    ``pieces(skip_special_tokens)[id]`` is the byte string a model token decodes to, ``b""`` for a skipped special
    token, and None for an added token: the Rust decoder inserts those verbatim and decodes the bytes on either side
    separately (an incomplete character before one becomes U+FFFD), so they are barriers, not bytes.
    A table is a snapshot: tokens added to the tokenizer after it was built are decoded as unknown ids (dropped).
    """

    def __init__(self, tokenizer):
        self.backend = _backend(tokenizer)
        added = self.backend.get_added_tokens_decoder()
        self.added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel) and not _cleans_up_spaces(tokenizer)
        self.byte_level = byte_level
        self._pieces = self._byte_pieces() if byte_level else None

    def _byte_pieces(self) -> dict[bool, list[bytes | None]]:
        translation = _byte_level_translation()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        keep: list[bytes | None] = [b""] * (max([*vocab.values(), *self.added, -1]) + 1)
        for token, i in vocab.items():
            try:
                keep[i] = token.translate(translation).encode("latin-1")
            except UnicodeEncodeError:  # as the ByteLevel decoder: a char outside its alphabet keeps the UTF-8
                keep[i] = token.encode()
        for i in self.added:
            keep[i] = None
        skip = [b"" if i in self.special_ids else piece for i, piece in enumerate(keep)]
        return {False: keep, True: skip}

    def pieces(self, skip_special_tokens: bool) -> list[bytes | None]:
        return self._pieces[skip_special_tokens]

    @classmethod
    def of(cls, tokenizer) -> TokenTable:
        """The table of ``tokenizer``, built on first use; a TokenTable passes through."""
        if isinstance(tokenizer, TokenTable):
            return tokenizer
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = cls(tokenizer)
        return table


# A memo, not configuration: building a table walks the whole vocabulary (~0.1 s for 128k tokens), too much
# per request, and callers pass the tokenizer itself. Weak keys let a dropped tokenizer take its table with it.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ByteLevelStream:
    """Exact per-token decoding for byte-level BPE: bytes through an incremental UTF-8 decoder."""

    def __init__(self, table: TokenTable, skip_special_tokens: bool):
        self._table = table
        self._pieces = table.pieces(skip_special_tokens)
        # errors="replace" replaces maximal invalid subsequences, as Rust's from_utf8_lossy does, and holds back an
        # incomplete trailing character until its bytes arrive.
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_ids: Sequence[int]) -> str:
        try:
            data = b"".join(map(self._pieces.__getitem__, token_ids))
        except (TypeError, IndexError):  # an added token (None) or an id past the vocabulary
            return self._push_slow(token_ids)
        return self._utf8.decode(data)

    def _push_slow(self, token_ids: Sequence[int]) -> str:
        out, pending = [], []
        for i in token_ids:
            piece = self._pieces[i] if 0 <= i < len(self._pieces) else b""  # decode() drops unknown ids
            if piece is not None:
                pending.append(piece)
                continue
            out.append(self._utf8.decode(b"".join(pending), final=True))
            out.append(self._table.added[i])
            pending = []
        out.append(self._utf8.decode(b"".join(pending)))
        return "".join(out)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _OffsetStream:
    """Any decoder: re-decode the ids since the last complete character (DecodeStream's and vLLM's method)."""

    def __init__(self, table: TokenTable, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
        self._decode = table.backend.decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the window re-decoded each step
        self._read = len(self._ids)  # ids before this are emitted
        self._prefix_text = self._decode(self._ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        # A trailing U+FFFD is an incomplete character: wait for its remaining bytes.
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        diff = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        return diff

    def flush(self) -> str:
        text = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        diff = text[len(self._prefix_text) :]
        self._prefix, self._read, self._prefix_text = self._read, len(self._ids), text
        return diff


class IncrementalDetokenizer:
    """Token ids in, new text out; never emits half a character.

    ``tokenizer`` is a transformers tokenizer, a raw ``tokenizers.Tokenizer``, or a prebuilt TokenTable.
    ``prompt_token_ids`` only give context to non-byte-level decoders; byte-level text does not depend on them.
    ``clean_up_tokenization_spaces`` is never applied: it rewrites text across token boundaries.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        table = TokenTable.of(tokenizer)
        if table.byte_level:
            self._stream = _ByteLevelStream(table, skip_special_tokens)
        else:
            self._stream = _OffsetStream(table, prompt_token_ids, skip_special_tokens)
        self.token_ids: list[int] = []
        self._chunks: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the text they complete (maybe "", while a character is split)."""
        self.token_ids.extend(token_ids)
        diff = self._stream.push(token_ids)
        if diff:
            self._chunks.append(diff)
        return diff

    def flush(self) -> str:
        """At finish: the held-back tail (an incomplete character becomes U+FFFD, as decode() would)."""
        diff = self._stream.flush()
        if diff:
            self._chunks.append(diff)
        return diff

    @property
    def text(self) -> str:
        # Joined on demand: appending to one str attribute per token would copy it each time (quadratic).
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""


class StopStringMatcher:
    """Finds stop strings in streamed text and says how much of it is safe to emit."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        # Chars that can end a proper prefix of some stop string; any other last char means nothing to hold back.
        self._prefix_last_chars = frozenset(c for s in self.stop for c in s[:-1])
        self._prefixes = [[s[:k] for k in range(len(s) - 1, 0, -1)] for s in self.stop]  # longest first

    def find(self, text: str) -> tuple[int, str] | None:
        """(where to cut ``text``, the stop string) for the occurrence that ends first, else None.

        Ending first (ties: the longer one) is what a character-by-character stream would stop at, so the result
        does not depend on how tokens were chunked.
        """
        best = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < (best[0] + len(best[1]), best[0])):
                best = (start, s)
        if best is None:
            return None
        start, s = best
        return (start + len(s) if self.include_stop_str_in_output else start), s

    def held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that a stop string could still start with."""
        if not text or text[-1] not in self._prefix_last_chars:
            return 0
        longest = 0
        for prefixes in self._prefixes:
            for prefix in prefixes:
                if len(prefix) <= longest:
                    break
                if text.endswith(prefix):
                    longest = len(prefix)
                    break
        return longest


class CandidateText:
    """The text of one candidate sequence: detokenization, stop strings, and what to stream.

    Streamed diffs never show text the final output drops, so their concatenation always equals ``text``.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = StopStringMatcher(stop, include_stop_str_in_output) if any(stop) else None
        self._pending = ""  # detokenized text held back because a stop string may start in it
        self._chunks: list[str] = []
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller should abort the request (should_abort)."""
        return self.stop_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Ids taken so far: those of the add() that matched a stop string are kept, later ones are not."""
        return self.detokenizer.token_ids

    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed generated ids; returns (text to stream now, the stop string matched by them or None)."""
        if self.stopped or self.finished:
            return "", None
        new = self.detokenizer.push(token_ids)
        if self._matcher is None:
            if new:
                self._chunks.append(new)
            return new, None
        return self._advance(new, final=False)

    def finish(self) -> str:
        """At the end of generation: the last diff (held-back bytes and stop-string prefixes are released)."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        tail = self.detokenizer.flush()
        if self._matcher is None:
            if tail:
                self._chunks.append(tail)
            return tail
        return self._advance(tail, final=True)[0]

    def _advance(self, new: str, final: bool) -> tuple[str, str | None]:
        # A stop string that completes now starts inside the held-back text (or later): it is the longest suffix
        # of what was emitted that a stop string starts with, so searching pending + new is enough.
        window = self._pending + new
        match = self._matcher.find(window)
        if match is not None:
            cut, self.stop_reason = match
            emit, self._pending = window[:cut], ""
        else:
            hold = 0 if final else self._matcher.held_back(window)
            emit, self._pending = window[: len(window) - hold], window[len(window) - hold :]
        if emit:
            self._chunks.append(emit)
        return emit, self.stop_reason

    @property
    def text(self) -> str:
        """All text streamed so far; after a stop or finish(), the final text."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
