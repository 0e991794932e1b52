"""A reasoning parser: a model family's thought tags, and where a request's output starts.

  qwen3        <think> ... </think>; an output that does not open with <think> is all answer
               (Qwen3 with thinking off, or a model that chose not to think)
  deepseek_r1  the same tags; the output is thought until </think> even without <think>
               (DeepSeek-R1 writes the opening tag into its chat template, not its output)

Where the output starts is read from the prompt's end, not assumed: a chat template that
writes `<think>` after the generation prompt (DeepSeek-R1, Qwen3's thinking-only releases)
opens the thought in the prompt, so the output is thought from its first token; one that
writes an empty `<think>\\n\\n</think>` (Qwen3's `enable_thinking: false`) closes it, so the
output is all answer and a grammar applies from the first token.

Both tags must be single tokens of the tokenizer (they are in both families): the grammar's
gate (structured/manager.py) watches token ids, the text split (split.py) watches text.
"""
from __future__ import annotations

import dataclasses
import enum


class Phase(enum.Enum):
    THINKING = "thinking"     # inside the thought: until the end tag
    MAYBE = "maybe"           # the next token decides: the start tag opens a thought
    ANSWER = "answer"         # after the thought (or none): a grammar applies here


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str                 # the tags' text
    end: str
    start_id: int              # ... and their token ids
    end_id: int
    thinks_first: bool         # without a tag at the prompt's end: thought (R1) or maybe (qwen3)

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer) -> "ReasoningParser":
        """ValueError if `name` is unknown or the tokenizer lacks single-token tags."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                             f"{sorted(REASONING_PARSERS)}")
        if tokenizer is None:
            raise ValueError(f"reasoning parser {name!r} needs the model's tokenizer")
        start, end, thinks_first = REASONING_PARSERS[name]
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (start, end) if tag not in vocab]
        if missing:
            raise ValueError(f"reasoning parser {name!r}: the tokenizer has no token "
                             f"{' or '.join(missing)} (is this a reasoning model?)")
        return cls(name, start, end, vocab[start], vocab[end], thinks_first)

    def first_phase(self, prompt_ids: list[int], decode) -> Phase:
        """The phase the output starts in. `decode(ids) -> str` reads the prompt's tail: a tag
        counts only if nothing but whitespace follows it (a tag in an earlier turn does not)."""
        last = None
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] in (self.start_id, self.end_id):
                last = i
                break
        if last is not None and not decode(prompt_ids[last + 1:]).strip():
            return Phase.THINKING if prompt_ids[last] == self.start_id else Phase.ANSWER
        return Phase.THINKING if self.thinks_first else Phase.MAYBE

    def next_phase(self, phase: Phase, token: int) -> Phase:
        """The phase after the output token `token` (sampled in `phase`)."""
        if phase is Phase.THINKING:
            return Phase.ANSWER if token == self.end_id else Phase.THINKING
        if phase is Phase.MAYBE:
            return Phase.THINKING if token == self.start_id else Phase.ANSWER
        return Phase.ANSWER


# name: (start tag, end tag, thinks first)
REASONING_PARSERS = {"qwen3": ("<think>", "</think>", False),
                     "deepseek_r1": ("<think>", "</think>", True)}


def get_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    return None if name is None else ReasoningParser.for_tokenizer(name, tokenizer)
