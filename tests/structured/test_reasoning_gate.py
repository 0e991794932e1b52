"""The grammar starts after the thought: the structured-output manager with a reasoning parser
(the real manager and llguidance on the embedded tokenizer with <think> tags added; no engine).
While a sequence thinks its rows are free and its matcher consumes nothing; from the token after
</think> its masks are a fresh matcher's; a prompt that closes the thought (thinking off)
constrains from the first token; a "maybe" row allows the grammar or <think>; speculative rows
past a drafted </think> get the grammar after the drafts between."""
from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import SamplingParams, StructuredOutputsParams

REGEX = r"[0-9]+x"


@pytest.fixture(scope="module")
def tok():
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    tok = load_tokenizer(embedded_gguf_path())
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.fixture(scope="module")
def manager(tok):
    from jaxbatch.reasoning import ReasoningParser
    from jaxbatch.structured.manager import StructuredOutputManager
    return StructuredOutputManager(tok, len(tok), (tok.eos_token_id,),
                                   reasoning=ReasoningParser.for_tokenizer("qwen3", tok))


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def make_seq(manager, tok, seq_id, prompt_text):
    from jaxbatch.core.request import Sequence
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX))
    seq = Sequence(seq_id, f"r{seq_id}", 0, ids(tok, prompt_text), params, 0, 0.0, 0, 0)
    manager.add(seq)
    return seq


def row(seq, position):
    from jaxbatch.core.plan import SamplingRow
    return SamplingRow(seq.seq_id, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, position,
                       seq.num_prompt_tokens, [], [], None)


def grammar_mask(manager, seq, consumed):
    """A fresh matcher's mask after `consumed` answer tokens."""
    import llguidance.numpy as lln
    m = manager._compile(seq.params).deep_copy()
    assert m.consume_tokens(consumed)
    mask = lln.allocate_token_bitmask(1, manager.vocab_size)
    lln.fill_next_token_bitmask(m, mask, 0)
    return mask[0]


def bit(mask_row, token):
    return bool((mask_row[token >> 5] >> (token & 31)) & 1)


def test_the_thought_is_free_and_the_answer_follows_the_grammar(manager, tok):
    seq = make_seq(manager, tok, 1, "<|im_start|>assistant\n<think>\n")
    try:
        words, end = ids(tok, " maybe twelve"), tok.convert_tokens_to_ids("</think>")
        one, x = ids(tok, "1")[0], ids(tok, "x")[0]
        rejected = manager.num_rejected_tokens
        for k in range(len(words) + 1):             # thinking: every row free
            assert not manager.is_answering(seq.seq_id)
            mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
            assert (mask == -1).all()
            seq.output_token_ids.append(words[k] if k < len(words) else end)
            manager.advance(seq)
        assert manager.is_answering(seq.seq_id)      # ... until </think>
        mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
        assert (mask[0] == grammar_mask(manager, seq, [])).all()
        assert not bit(mask[0], x) and not bit(mask[0], words[0])
        seq.output_token_ids.append(one)
        manager.advance(seq)
        mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
        assert (mask[0] == grammar_mask(manager, seq, [one])).all() and bit(mask[0], x)
        assert manager.num_rejected_tokens == rejected, "the thought reached the grammar"
    finally:
        manager.remove(seq.seq_id)


def test_a_prompt_that_closes_the_thought_constrains_from_the_first_token(manager, tok):
    seq = make_seq(manager, tok, 2, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    try:
        assert manager.is_answering(seq.seq_id)
        mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
        assert (mask[0] == grammar_mask(manager, seq, [])).all()
        assert not bit(mask[0], tok.convert_tokens_to_ids("<think>"))
    finally:
        manager.remove(seq.seq_id)


def test_maybe_allows_the_grammar_or_an_opening_tag(manager, tok):
    start, one = tok.convert_tokens_to_ids("<think>"), ids(tok, "1")[0]
    for first, answering in ((start, False), (one, True)):
        seq = make_seq(manager, tok, 3, "<|im_start|>assistant\n")
        try:
            mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
            expect = grammar_mask(manager, seq, []).copy()
            assert not bit(expect, start)
            expect.view(np.uint32)[start >> 5] |= np.uint32(1 << (start & 31))
            assert (mask[0] == expect).all()
            seq.output_token_ids.append(first)
            manager.advance(seq)
            assert manager.is_answering(seq.seq_id) is answering
            mask = manager.fill_bitmask([row(seq, seq.num_tokens)])
            if answering:                            # "1" was the answer's first token
                assert (mask[0] == grammar_mask(manager, seq, [one])).all()
            else:
                assert (mask == -1).all()
        finally:
            manager.remove(seq.seq_id)


def test_speculative_rows_past_a_drafted_end_of_thought(manager, tok):
    seq = make_seq(manager, tok, 4, "<|im_start|>assistant\n<think>\n")
    try:
        word, end = ids(tok, " so")[0], tok.convert_tokens_to_ids("</think>")
        one, two = ids(tok, "1")[0], ids(tok, "2")[0]
        base = seq.num_tokens
        rows = [row(seq, base + j) for j in range(5)]
        mask = manager.fill_bitmask(rows, {seq.seq_id: [word, end, one, two]})
        assert (mask[0] == -1).all() and (mask[1] == -1).all()     # in the thought
        for j, consumed in ((2, []), (3, [one]), (4, [one, two])):
            assert (mask[j] == grammar_mask(manager, seq, consumed)).all(), j
        assert not manager.is_answering(seq.seq_id)   # drafts are tentative
        again = manager.fill_bitmask([row(seq, base)])
        assert (again == -1).all()
    finally:
        manager.remove(seq.seq_id)
