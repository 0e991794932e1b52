"""The reasoning parsers on token streams, no engine: where the output starts (read from the
prompt's end), the thought split from the answer as text grows one token at a time (tags split
across tokens, a thought cut short), and the phase the grammar gate follows token by token."""
from __future__ import annotations

import pytest

from jaxbatch.reasoning import Phase, ReasoningParser, ReasoningSplit

START, END = 1000, 1001
WORDS = {START: "<think>", END: "</think>", 5: "\n", 6: "hello", 7: " world", 8: " ", 9: "<"}


def decode(ids):
    return "".join(WORDS.get(i, f"w{i}") for i in ids)


def parser(name="qwen3"):
    return ReasoningParser(name, "<think>", "</think>", START, END, name == "deepseek_r1")


def streamed(split: ReasoningSplit, pieces: list[str]):
    """Feeds the text piece by piece as a stream would; returns the deltas of each part as
    sent (suffixes of what was sent before) and the final split."""
    text, sent_r, sent_c, deltas = "", "", "", []
    for k, piece in enumerate(pieces):
        text += piece
        reasoning, content = split.split(text, final=k == len(pieces) - 1)
        reasoning = reasoning or ""
        assert reasoning.startswith(sent_r) and content.startswith(sent_c), "a part shrank"
        deltas.append((reasoning[len(sent_r):], content[len(sent_c):]))
        sent_r, sent_c = reasoning, content
    return deltas, (sent_r, sent_c)


@pytest.mark.parametrize("prompt, name, phase", [
    ([6, START, 5], "qwen3", Phase.THINKING),            # the template opened the thought
    ([6, START, 5, 5, END, 5, 5], "qwen3", Phase.ANSWER),  # enable_thinking: false
    ([6, 7], "qwen3", Phase.MAYBE),                       # the model may open one itself
    ([6, 7], "deepseek_r1", Phase.THINKING),              # R1: thought until </think>
    ([START, 6, END, 6, 7], "qwen3", Phase.MAYBE),        # a tag of an earlier turn: not ours
    ([START, 6, END, 6, 7], "deepseek_r1", Phase.THINKING),
    ([6, START, 8], "deepseek_r1", Phase.THINKING),
])
def test_first_phase_is_read_from_the_prompts_end(prompt, name, phase):
    assert parser(name).first_phase(prompt, decode) is phase


def test_phase_follows_the_tokens():
    p = parser()
    assert p.next_phase(Phase.MAYBE, START) is Phase.THINKING
    assert p.next_phase(Phase.MAYBE, 6) is Phase.ANSWER
    assert p.next_phase(Phase.THINKING, 6) is Phase.THINKING
    assert p.next_phase(Phase.THINKING, END) is Phase.ANSWER
    assert p.next_phase(Phase.ANSWER, START) is Phase.ANSWER


def test_unknown_parser_or_missing_tags_are_refused():
    class Tok:
        def get_vocab(self):
            return {"<think>": 3}
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser.for_tokenizer("nope", Tok())
    with pytest.raises(ValueError, match="no token </think>"):
        ReasoningParser.for_tokenizer("qwen3", Tok())


# Tags split across tokens every way a tokenizer may spell them.
TAG_SPLITS = [["</think>"], ["</", "think", ">"], ["<", "/", "th", "ink", ">"],
              ["</think", ">\n\n"]]


@pytest.mark.parametrize("tag", TAG_SPLITS)
def test_a_streamed_end_tag_split_across_tokens_never_leaks(tag):
    pieces = ["Let", " me", " think", " <", "b>"] + tag + ["\n\n", "{\"a\"", ":1}"]
    deltas, (reasoning, content) = streamed(ReasoningSplit(parser(), Phase.THINKING), pieces)
    assert reasoning == "Let me think <b>"
    assert content == '{"a":1}'
    assert "".join(r for r, _ in deltas) == reasoning       # sent once, in order
    assert "".join(c for _, c in deltas) == content
    assert not any("<" in c or "/" in c for _, c in deltas[:-2]), "a tag's head leaked"
    assert all("</" not in r and "think>" not in r for r, _ in deltas)


@pytest.mark.parametrize("tag", [["<think>"], ["<", "think", ">"], ["<th", "ink>\n"]])
def test_a_thought_the_model_opens_itself(tag):
    pieces = tag + ["plan", "</think>", "\n\n", "answer"]
    deltas, (reasoning, content) = streamed(ReasoningSplit(parser(), Phase.MAYBE), pieces)
    assert reasoning.strip() == "plan" and content == "answer"
    assert all(not r.startswith("<") and not c.startswith("<") for r, c in deltas)


def test_no_thought_is_all_answer():
    split = ReasoningSplit(parser(), Phase.MAYBE)
    assert split.split("Hello <b>", final=False) == (None, "Hello <b>")
    assert split.split("<", final=False) == (None, "")            # maybe <think>: held
    assert split.split("<", final=True) == (None, "<")
    assert ReasoningSplit(parser(), Phase.ANSWER).split("<think>x</think>y", True) == \
        (None, "<think>x</think>y")


def test_a_thought_cut_short_stays_reasoning():
    split = ReasoningSplit(parser(), Phase.THINKING)
    assert split.split("still thinking </thi", final=False) == ("still thinking ", "")
    assert split.split("still thinking </thi", final=True) == ("still thinking </thi", "")


def test_deepseek_r1_strips_an_opening_tag_it_writes_anyway():
    split = ReasoningSplit(parser("deepseek_r1"), Phase.THINKING)
    assert split.split("<think>\nhm</think>ok", final=True) == ("\nhm", "ok")
    assert split.split("hm</think>\n ok", final=True) == ("hm", "ok")
