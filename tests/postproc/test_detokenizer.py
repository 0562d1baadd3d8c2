"""Incremental detokenization and stop strings against the tiny byte-level BPE tokenizer."""

from __future__ import annotations

import random
import time

import pytest
from transformers import AutoTokenizer

from raypd.tools import tiny
from postproc.detokenizer import CandidateText, IncrementalDetokenizer, StopStringMatcher, TokenTable, _OffsetStream

FFFD = "\ufffd"
TEXTS = [
    "hello world café naïve",
    "你好世界 and 🙂🚀 then straße",
    " leading space, then\nnewline 🚀🚀 résumé",
    "καλημέρα κόσμε 你好 🙂",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    tiny.build_tokenizer(tiny.SIZES["tiny"].vocab_size).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def tokenizer_with_added(tmp_path_factory):
    # Non-special added tokens are inserted verbatim by decode() and split the bytes around them.
    out = tmp_path_factory.mktemp("tok_added")
    tiny.build_tokenizer(tiny.SIZES["tiny"].vocab_size).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<tool>", " héllo"])
    return tok


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def random_ids(tok, rng, n):
    """Mix of real text (multi-byte chars split across tokens), raw random ids and special tokens."""
    ids = []
    specials = list(tok.all_special_ids)
    while len(ids) < n:
        roll = rng.random()
        if roll < 0.4:
            ids += encode(tok, rng.choice(TEXTS))[: rng.randint(1, 12)]
        elif roll < 0.8:
            ids.append(rng.randrange(len(tok)))
        else:
            ids.append(rng.choice(specials))
    return ids[:n]


def check_exact(tok, ids, chunk, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    emitted = ""
    for i in range(0, len(ids), chunk):
        diff = detok.push(ids[i : i + chunk])
        emitted += diff
        expected = tok.decode(ids[: i + chunk], skip_special_tokens=skip_special_tokens)
        # Complete text is emitted at once; an incomplete trailing character is held back, never shown as U+FFFD.
        if expected.endswith(FFFD):
            assert expected.startswith(emitted)
        else:
            assert emitted == expected
    emitted += detok.flush()
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert emitted == full == detok.text
    assert detok.token_ids == list(ids)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_match_decode(tokenizer, chunk, skip_special_tokens):
    rng = random.Random(chunk * 10 + skip_special_tokens)
    for _ in range(200):
        check_exact(tokenizer, random_ids(tokenizer, rng, rng.randint(1, 40)), chunk, skip_special_tokens)


@pytest.mark.parametrize("chunk", [1, 3])
def test_added_tokens_split_bytes_like_decode(tokenizer_with_added, chunk):
    tok = tokenizer_with_added
    added = tok.convert_tokens_to_ids(["<tool>", " héllo"])
    rng = random.Random(7)
    for _ in range(200):
        ids = random_ids(tok, rng, rng.randint(1, 30))
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(added))
        for skip in (True, False):
            check_exact(tok, ids, chunk, skip)


def test_valid_text_never_streams_replacement_char(tokenizer):
    for text in TEXTS + ["🙂" * 5, "你好世界" * 3, "café" * 4]:
        ids = encode(tokenizer, text)
        detok = IncrementalDetokenizer(tokenizer)
        diffs = [detok.push([i]) for i in ids] + [detok.flush()]
        assert not any(FFFD in d for d in diffs)
        assert "".join(diffs) == text
    # The tokenizer really splits these characters, or the test would prove nothing.
    assert any("" == IncrementalDetokenizer(tokenizer).push([i]) for i in encode(tokenizer, "🙂"))


def test_leading_space_of_first_generated_token(tokenizer):
    prompt = encode(tokenizer, "hello")
    gen = encode(tokenizer, " world café")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert detok.push(gen[:1]).startswith(" ")
    detok.push(gen[1:])
    assert detok.text == " world café" == tokenizer.decode(gen)


def test_incomplete_character_at_finish_is_flushed_as_replacement(tokenizer):
    ids = encode(tokenizer, "ok 🚀")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert FFFD not in "".join(detok.push([i]) for i in ids)
    assert detok.flush() == FFFD
    assert detok.text == tokenizer.decode(ids)


def test_unknown_ids_are_dropped_like_decode(tokenizer):
    ids = encode(tokenizer, "a b") + [len(tokenizer) + 5] + encode(tokenizer, " c")
    check_exact(tokenizer, ids, 1)


def test_table_matches_single_token_decode(tokenizer_with_added):
    tok = tokenizer_with_added
    table = TokenTable.of(tok)
    assert table.byte_level and TokenTable.of(tok) is table
    pieces = table.pieces(False)
    for i in range(len(tok)):
        piece = table.added[i] if pieces[i] is None else pieces[i].decode("utf-8", "replace")
        assert piece == tok.backend_tokenizer.decode([i], skip_special_tokens=False), i


@pytest.mark.parametrize("chunk", [1, 3])
def test_offset_stream_fallback_matches_decode(tokenizer, chunk):
    table = TokenTable.of(tokenizer)
    rng = random.Random(3)
    for _ in range(100):
        ids = random_ids(tokenizer, rng, rng.randint(1, 40))
        s = _OffsetStream(table, (), skip_special_tokens=True)
        text = "".join(s.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + s.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


# --- stop strings ---------------------------------------------------------------------------


def run_candidate(tok, ids, chunk=1, **kwargs):
    """Stream ids through a CandidateText; checks every streamed prefix against the final text."""
    cand = CandidateText(tok, **kwargs)
    diffs, reasons = [], []
    for i in range(0, len(ids), chunk):
        diff, reason = cand.add(ids[i : i + chunk])
        diffs.append(diff)
        reasons.append(reason)
        if cand.stopped:
            break
    diffs.append(cand.finish())
    assert "".join(diffs) == cand.text
    assert [r for r in reasons if r is not None] == ([cand.stop_reason] if cand.stopped else [])
    return cand, diffs


def test_stop_string_split_across_tokens(tokenizer):
    ids = encode(tokenizer, "hello world the end of it all")
    stop = "the end"
    assert stop not in {tokenizer.decode([i]) for i in ids}  # really spans tokens
    cand, diffs = run_candidate(tokenizer, ids, stop=[stop])
    assert cand.text == "hello world " and cand.stop_reason == stop and cand.stopped
    assert not any(part in d for d in diffs for part in ("the", " end"))
    cand, _ = run_candidate(tokenizer, ids, stop=[stop], include_stop_str_in_output=True)
    assert cand.text == "hello world the end" and cand.stop_reason == stop


def test_multibyte_stop_string(tokenizer):
    ids = encode(tokenizer, "say 你好世界 now 🙂🚀 ok")
    for stop, expected in (("世界", "say 你好"), ("🚀", "say 你好世界 now 🙂")):
        for chunk in (1, 3):
            cand, diffs = run_candidate(tokenizer, ids, chunk, stop=[stop])
            assert cand.text == expected and not any(FFFD in d for d in diffs)


def test_earliest_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "the quick brown fox jumps")
    for chunk in (1, 3, len(ids)):
        cand, _ = run_candidate(tokenizer, ids, chunk, stop=["fox", "quick"])
        assert (cand.text, cand.stop_reason) == ("the ", "quick")


def test_overlapping_stop_strings_end_first_wins_for_any_chunking(tokenizer):
    ids = encode(tokenizer, "a quick brown fox")
    for stop, expected in ((["quick brown fox", "brown"], "a quick "), (["brown", "quick brown"], "a ")):
        results = {run_candidate(tokenizer, ids, c, stop=stop)[0].text for c in (1, 2, 3, len(ids))}
        assert results == {expected}  # the one that completes first; on a tie, the longer


def test_stop_string_in_prompt_only_does_not_stop(tokenizer):
    prompt = encode(tokenizer, "hello world the")
    ids = encode(tokenizer, " end is near")
    for stop in ("hello", "the end"):  # wholly in the prompt; straddling prompt and output
        cand, _ = run_candidate(tokenizer, ids, stop=[stop], prompt_token_ids=prompt)
        assert not cand.stopped and cand.text == " end is near"


def test_held_back_prefix_released_at_finish(tokenizer):
    ids = encode(tokenizer, "this is the e")
    cand = CandidateText(tokenizer, stop=["the end"])
    streamed = "".join(cand.add([i])[0] for i in ids)
    assert streamed == "this is "
    assert cand.finish() == "the e" and cand.text == "this is the e" and not cand.stopped


def test_no_text_after_stop(tokenizer):
    ids = encode(tokenizer, "red green blue")
    cand = CandidateText(tokenizer, stop=["green"])
    for i in ids:
        cand.add([i])
    assert cand.stopped and cand.add(encode(tokenizer, " more")) == ("", None) and cand.finish() == ""
    # Ids after the one that completed the stop string are not taken.
    assert cand.text == "red " and cand.token_ids == encode(tokenizer, "red green")


def test_random_stop_strings_match_reference(tokenizer):
    rng = random.Random(11)
    words = ["the", "café", "你好", "世界", "🙂", "🚀", "world", "end", "fox", ",", "."]
    for _ in range(150):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))
        stops = [text[a : a + rng.randint(1, 6)] for a in (rng.randrange(len(text)) for _ in range(rng.randint(1, 3)))]
        stops += [rng.choice(words) + "!"]  # one that never matches
        include = rng.random() < 0.5
        ids = encode(tokenizer, text)
        ref = reference_stop(text, stops, include)
        for chunk in (1, 3):
            cand, diffs = run_candidate(tokenizer, ids, chunk, stop=stops, include_stop_str_in_output=include)
            assert (cand.text, cand.stop_reason) == ref, (text, stops)


def reference_stop(text, stops, include):
    """Scan the final text one character at a time: the first stop string to complete wins (ties: longest)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


def test_matcher_held_back():
    m = StopStringMatcher(["abc", "xyz"])
    assert [m.held_back(t) for t in ("", "q", "a", "ab", "abc", "zab", "xy", "ax")] == [0, 0, 1, 2, 0, 2, 2, 1]


# --- throughput -----------------------------------------------------------------------------


def corpus_ids(tok, n):
    ids = []
    for line in tiny.corpus(num_sentences=20_000, seed=99):
        ids += encode(tok, line + " ")
        if len(ids) >= n:
            return ids[:n]
    return ids


def test_throughput_one_token_per_push(tokenizer):
    ids = corpus_ids(tokenizer, 50_000)
    for name, make in (
        ("IncrementalDetokenizer", lambda: IncrementalDetokenizer(tokenizer)),
        ("CandidateText, no stop", lambda: CandidateText(tokenizer)),
        ("CandidateText, 2 stops", lambda: CandidateText(tokenizer, stop=["<|end|>", "\n\n"])),
    ):
        obj = make()
        push = obj.push if isinstance(obj, IncrementalDetokenizer) else obj.add
        t0 = time.perf_counter()
        for i in ids:
            push([i])
        rate = len(ids) / (time.perf_counter() - t0)
        print(f"\n{name}: {rate / 1000:.0f}k tokens/s ({len(ids)} tokens, 1 per push)")
        assert rate > 20_000
