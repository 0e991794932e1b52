"""Incremental detokenization (jaxbatch/engine/detokenizer.py) against the full re-decode it replaces,
on the embedded model's tokenizer. No engine, no device."""
from __future__ import annotations

import random

import pytest

from jaxbatch.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café au lait, naïve façade, jalapeño — “quoted” ‘text’ … ok",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🙂🎉👩‍👩‍👧‍👦 🇫🇷 and ∑∫√∞ math, ☃ snowman",
    "def f(x):\n    return x ** 2  # a comment\n\n\tTabs and   spaces",
    "Ünïcödé ẞ ǅ Ω ≈ ç ø å ß — Привет, мир! Γειά σου κόσμε",
]


@pytest.fixture(scope="module")
def tok():
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    return load_tokenizer(embedded_gguf_path())


def _stream(tok, ids, skip=True, stop=None, chunks=None):
    """Feeds ids as a generator would (one or a few at a time); returns the detokenizer and
    the list of (text, output_text) seen after each update."""
    detok = IncrementalDetokenizer(tok, skip, stop)
    seen, out, i = [], [], 0
    rng = random.Random(len(ids))
    while i < len(ids):
        k = rng.choice(chunks) if chunks else 1
        out.extend(ids[i:i + k])
        i += k
        final = i >= len(ids)
        detok.update(out, final=final)
        seen.append((detok.text, detok.output_text(final)))
        if detok.stop_reason is not None:
            break
    return detok, seen


def _random_ids(tok, rng, n):
    """Half real text of many scripts (multi-byte characters split across tokens), half ids
    drawn from the whole vocabulary (special tokens and lone UTF-8 bytes included)."""
    ids = []
    while len(ids) < n:
        if rng.random() < 0.5:
            ids += tok(rng.choice(TEXTS))["input_ids"][:rng.randint(1, 30)]
        else:
            ids += [rng.randrange(len(tok)) for _ in range(rng.randint(1, 5))]
    return ids[:n]


@pytest.mark.parametrize("skip", [True, False])
def test_equals_full_decode_on_random_sequences(tok, skip):
    rng = random.Random(0)
    for trial in range(60):
        ids = _random_ids(tok, rng, rng.randint(1, 120))
        detok, seen = _stream(tok, ids, skip, chunks=[1, 1, 1, 2, 3])
        full = tok.decode(ids, skip_special_tokens=skip)
        assert detok.text == full, (trial, ids)
        # What was shown never changes afterwards: each text is a prefix of the next.
        for (a, _), (b, _) in zip(seen, seen[1:]):
            assert b.startswith(a), (trial, ids)


def test_valid_text_never_shows_a_replacement_char(tok):
    """Multi-byte characters split across tokens are held back until complete."""
    split_somewhere = False
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        split_somewhere |= any(REPLACEMENT in tok.decode([i]) for i in ids)
        detok, seen = _stream(tok, ids)
        assert detok.text == text == tok.decode(ids)
        for partial, _ in seen:
            assert REPLACEMENT not in partial and text.startswith(partial)
    assert split_somewhere, "no character was split across tokens: the test would prove nothing"


def _reference(tok, ids, stop):
    """What LLMEngine did before: re-decode everything each step, take the earliest stop."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            index, s = min(hits)
            return n, text[:index], s
    return len(ids), tok.decode(ids, skip_special_tokens=True), None


def test_stop_strings_match_full_redecode_and_never_leak(tok):
    rng = random.Random(1)
    spanning = 0
    for trial in range(120):
        text = " ".join(rng.sample(TEXTS, 3))
        ids = tok(text)["input_ids"]
        start = rng.randrange(len(text) - 8)
        stop = [text[start:start + rng.randint(1, 8)]]
        if rng.random() < 0.5:                      # a second stop, maybe never matched
            stop.append(rng.choice(["zzzq", text[rng.randrange(len(text) - 3):][:3]]))
        n_ref, text_ref, stop_ref = _reference(tok, ids, stop)
        detok = IncrementalDetokenizer(tok, True, stop)
        shown = ""
        for n in range(1, len(ids) + 1):
            matched = detok.update(ids[:n], final=n == len(ids))
            if matched is not None or n == len(ids):
                break
            visible = detok.output_text(False)
            assert visible.startswith(shown)
            shown = visible
            # Nothing shown before the end may contain (the start of) a stop string that the
            # final text then cuts away.
            assert text_ref.startswith(shown), (trial, stop, shown)
        assert (n, detok.text, detok.stop_reason) == (n_ref, text_ref, stop_ref), (trial, stop)
        assert detok.output_text(True) == text_ref
        if stop_ref is not None:
            pieces = [tok.decode([i]) for i in ids[:n]]
            spanning += not any(stop_ref in p for p in pieces)
    assert spanning >= 20, "too few stop strings spanned tokens to test that case"


def test_holdback_is_longest_stop_minus_one(tok):
    ids = tok("abcdefghij klmnop")["input_ids"]
    detok = IncrementalDetokenizer(tok, True, ["xyz", "qqqqq"])
    detok.update(ids[:-1])
    assert detok.output_text(False) == detok.text[:-4]
    assert detok.output_text(True) == detok.text
    plain = IncrementalDetokenizer(tok, True, None)
    plain.update(ids[:-1])
    assert plain.output_text(False) == plain.text


def test_window_stays_small_on_long_outputs(tok):
    """O(1) per token: every decode call sees a handful of ids, however long the output."""
    lengths = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner
            self.clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = []
    for i in range(40):
        ids += tok(TEXTS[i % len(TEXTS)] + " ")["input_ids"]
    assert len(ids) > 1000
    detok, _ = _stream(Counting(tok), ids)
    assert detok.text == tok.decode(ids)
    assert len(lengths) <= 2 * len(ids) + 2
    assert max(lengths) <= 8, max(lengths)

