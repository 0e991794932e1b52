"""A completion's text, split into thought and answer as it grows.

`ReasoningSplit(parser, phase)` is made once per completion with the phase its prompt leaves
(parser.py); `split(text, final)` takes the whole text so far and returns (reasoning or None,
content). While the output runs, a tail that could still become a tag is held back, so a tag
split across tokens (or across stream deltas) never leaks its first characters into either
part, and each part only ever grows: deltas are suffixes, nothing is sent twice.

A thought cut short (max_tokens, an abort) stays reasoning: content is "" then. The content
after the end tag starts at its first non-whitespace character (Qwen3 and R1 write a blank
line there).
"""
from __future__ import annotations

from jaxbatch.reasoning.parser import Phase, ReasoningParser


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    def __init__(self, parser: ReasoningParser, phase: Phase):
        self.parser, self.phase = parser, phase

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        p = self.parser
        if self.phase is Phase.ANSWER:
            return None, text
        if self.phase is Phase.MAYBE:
            head = text.lstrip()
            if not head.startswith(p.start):
                if not final and p.start.startswith(head):
                    return None, ""            # maybe the opening tag, still arriving
                return None, text
            return self._thought(head[len(p.start):], final)
        head = text.lstrip()
        if head.startswith(p.start):           # R1-style: an opening tag the prompt implied
            text = head[len(p.start):]
        return self._thought(text, final)

    def _thought(self, text: str, final: bool) -> tuple[str, str]:
        end = self.parser.end
        i = text.find(end)
        if i < 0:
            hold = 0 if final else _partial_tag(text, end)
            return text[:len(text) - hold], ""
        return text[:i], text[i + len(end):].lstrip()
