"""Answers that close within max_tokens: for a matcher's state, a short text that takes the
grammar to an accepting state (strings end, arrays and objects close, required keys get
short values), how many tokens it costs, and which next tokens stay on it.

The text is found by walking the matcher itself, so every grammar llguidance compiles (JSON
schemas with their enums, bounds and required keys; regexes; Lark) is covered by the same
code: at each point take what the grammar forces, else the first byte of CLOSE_ORDER it
allows (closers before openers before literals). That walk is a short answer, not always the
shortest; its length is a safe bound, since following it does close. Its cost in tokens is
the fewest vocabulary tokens that spell it (any byte split is one llguidance accepts).

Host side, no JAX."""
from __future__ import annotations

import dataclasses

# Closers first; `"` is deferred behind the digits when it would open a string (a value
# `0` is one byte, `""` two); `,` before the digits, or `[1` would grow into `[100000...`.
CLOSE_ORDER = b'"}]:,0123456789{[ntf-' + bytes(c for c in range(32, 127)
                                                 if chr(c) not in '"}]:,0123456789{[ntf-')
MAX_WALK_BYTES = 1024      # a walk this long has found no close (e.g. regex `a+b` walks `aaa...`)
MAX_PIECE_BYTES = 32       # longer tokens (runs of spaces) never spell a closing text


@dataclasses.dataclass
class ClosePath:
    """A text that closes the grammar from the state it was found in."""
    text: bytes
    costs: list[int]        # costs[i]: fewest tokens that spell text[i:]; costs[len] = 0

    @property
    def tokens_needed(self) -> int:
        return self.costs[0]

    def after(self, piece: bytes) -> ClosePath | None:
        """The rest of the path once `piece` (a token's bytes) was written, if it lies on it."""
        if not self.text.startswith(piece):
            return None
        return ClosePath(self.text[len(piece):], self.costs[len(piece):])


class Closer:
    """Built once per llguidance tokenizer: the vocabulary by bytes."""

    def __init__(self, token_bytes: list[bytes], special: set[int]):
        self.token_bytes = token_bytes
        self.by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b and i not in special and len(b) <= MAX_PIECE_BYTES:
                self.by_bytes.setdefault(b, []).append(i)
        self.single = {b[0]: ids[0] for b, ids in self.by_bytes.items() if len(b) == 1}

    # ---- finding a close ---------------------------------------------------------------------
    def find(self, matcher) -> ClosePath | None:
        """A closing path from the matcher's state (left as it was), or None if the walk finds
        no accepting state within MAX_WALK_BYTES or the matcher is in error."""
        if matcher.is_error():
            return None
        text, ids = bytearray(), []
        try:
            while not matcher.is_accepting():
                if len(text) >= MAX_WALK_BYTES or matcher.is_stopped():
                    return None
                step = self._forced(matcher) or self._next_byte(matcher)
                if step is None:
                    return None
                token, piece = step
                if not matcher.consume_token(token):
                    return None
                ids.append(token)
                text += piece
        finally:
            if ids:
                matcher.rollback(len(ids))
        return self._priced(bytes(text))

    def _forced(self, matcher) -> tuple[int, bytes] | None:
        """The longest vocabulary token spelling the start of what the grammar forces."""
        forced = matcher.compute_ff_bytes()
        for n in range(min(len(forced), MAX_PIECE_BYTES), 0, -1):
            for token in self.by_bytes.get(forced[:n], ()):
                if matcher.validate_tokens([token]) == 1:
                    return token, forced[:n]
        return None

    def _next_byte(self, matcher) -> tuple[int, bytes] | None:
        deferred_quote = None
        for byte in CLOSE_ORDER:
            token = self.single.get(byte)
            if token is None or matcher.validate_tokens([token]) != 1:
                continue
            if byte == ord('"') and self._opens_string(matcher, token):
                deferred_quote = token
                continue
            if byte == ord('{') and deferred_quote is not None:
                break
            return token, bytes([byte])
        if deferred_quote is not None:
            return deferred_quote, b'"'
        return None

    def _opens_string(self, matcher, quote: int) -> bool:
        """Whether `"` here opens a string (a value may follow) rather than closing one: only
        an opened string can be closed by a second `"` right away."""
        return matcher.validate_tokens([quote, quote]) == 2

    def _priced(self, text: bytes) -> ClosePath:
        """costs[i]: the fewest vocabulary tokens spelling text[i:] (right to left)."""
        n = len(text)
        costs = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            costs[i] = min(1 + costs[i + k] for k in range(1, min(n - i, MAX_PIECE_BYTES) + 1)
                           if text[i:i + k] in self.by_bytes)
        return ClosePath(text, costs)

    # ---- following it ------------------------------------------------------------------------
    def next_tokens(self, path: ClosePath, tokens_left: int) -> list[int]:
        """Tokens that lie on the path and leave enough tokens to finish it: token t spelling
        text[:k] with 1 + costs[k] <= tokens_left (at least the cheapest one, even when the
        budget is already short: the closest the answer can get)."""
        text, costs = path.text, path.costs
        keep, best = [], None
        for k in range(1, min(len(text), MAX_PIECE_BYTES) + 1):
            ids = self.by_bytes.get(text[:k])
            if not ids:
                continue
            if 1 + costs[k] <= tokens_left:
                keep += ids
            if best is None or costs[k] < costs[best[0]]:
                best = (k, ids)
        return keep or (best[1] if best else [])

    def keeps(self, matcher, path: ClosePath) -> bool:
        """Whether the path still closes the grammar from the matcher's (new) state: a token
        inside a string or a number usually leaves the close as it was."""
        ids = self.spell(path.text)
        if ids is None:
            return False
        n = matcher.try_consume_tokens(ids)
        ok = n == len(ids) and matcher.is_accepting()
        if n:
            matcher.rollback(n)
        return ok

    def spell(self, text: bytes) -> list[int] | None:
        """text as single-byte tokens (None if a byte has none)."""
        ids = [self.single.get(b) for b in text]
        return None if None in ids else ids
