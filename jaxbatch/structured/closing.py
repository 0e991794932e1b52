"""Answers that close within max_tokens: for a matcher's state, a short text that takes the
grammar to an accepting state (strings end, arrays and objects close, required keys get
short values), how many tokens it costs, and which next tokens stay on it.

The text is found by walking the matcher itself, so every grammar llguidance compiles (JSON
schemas with their enums, bounds and required keys; regexes; Lark) is covered by the same
code: at each point take what the grammar forces, else the first byte of CLOSE_ORDER it
allows (closers before openers before literals). That walk is a short answer, not always the
shortest; its length is a safe bound, since following it does close. Its cost in tokens is
the fewest vocabulary tokens that spell it: first by bytes alone, then (`exact`, once steering
nears) with only the tokens the grammar's masks allow along it.

Host side, no JAX."""
from __future__ import annotations

import dataclasses

import numpy as np

# Closers first; `"` is deferred behind the digits when it would open a string (a value
# `0` is one byte, `""` two); `,` before the digits, or `[1` would grow into `[100000...`.
CLOSE_ORDER = b'"}]:,0123456789{[ntf-' + bytes(c for c in range(32, 127)
                                                 if chr(c) not in '"}]:,0123456789{[ntf-')
CLOSERS = (b'"', b"}", b"]")   # (a `"` here closes a string: one that opens is reordered)
LOOK_AHEAD_OPTIONS = 8     # choices walked on at a branch (enum values start apart early)
MAX_WALK_BYTES = 1024      # a walk this long has found no close (e.g. regex `a+b` walks `aaa...`)
MAX_PIECE_BYTES = 32       # longer tokens (runs of spaces) never spell a closing text
# Bytes that open or end a JSON value, key or item: a token holding none of them stays inside
# a string or number (or starts a literal), so it leaves the close about as long as it was.
STRUCTURAL = frozenset(b'"{}[],:\\')
# Steering starts this many tokens before the budget is down to what the close costs: a token
# sampled freely just before may open something (a literal, a nested value) that costs more.
CLOSE_MARGIN = 8


@dataclasses.dataclass
class ClosePath:
    """A text that closes the grammar from the state it was found in."""
    text: bytes
    costs: list[int]        # costs[i]: fewest tokens that spell text[i:]; costs[len] = 0
    exact: bool = False     # costs counted with the tokens the masks allow (Closer.exact)

    @property
    def tokens_needed(self) -> int:
        return self.costs[0]

    def after(self, piece: bytes) -> ClosePath | None:
        """The rest of the path once `piece` (a token's bytes) was written, if it lies on it."""
        if not self.text.startswith(piece):
            return None
        return ClosePath(self.text[len(piece):], self.costs[len(piece):], self.exact)


class Closer:
    """Built once per llguidance tokenizer: the vocabulary by bytes."""

    def __init__(self, token_bytes: list[bytes], special: set[int]):
        self.token_bytes = token_bytes
        self.by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b and i not in special and len(b) <= MAX_PIECE_BYTES:
                self.by_bytes.setdefault(b, []).append(i)
        self.single = {b[0]: ids[0] for b, ids in self.by_bytes.items() if len(b) == 1}
        plain = np.zeros(((len(token_bytes) + 31) // 32) * 32, bool)
        plain[:len(token_bytes)] = [not STRUCTURAL.intersection(b) for b in token_bytes]
        self.plain_bits = np.packbits(plain, bitorder="little").view(np.int32)

    # ---- finding a close ---------------------------------------------------------------------
    def find(self, matcher) -> ClosePath | None:
        """A closing path from the matcher's state (left as it was), or None if the walk finds
        no accepting state within MAX_WALK_BYTES or the matcher is in error."""
        if matcher.is_error():
            return None
        text = self._walk(matcher, MAX_WALK_BYTES, look_ahead=True)
        return None if text is None else self._priced(text)

    def _walk(self, matcher, limit: int, look_ahead: bool) -> bytes | None:
        """The bytes of a walk to an accepting state (None past `limit` bytes)."""
        text, consumed = bytearray(), 0
        try:
            while not matcher.is_accepting():
                if len(text) >= limit or matcher.is_stopped():
                    return None
                step = self._forced(matcher) or self._choose(matcher, limit - len(text),
                                                             look_ahead)
                if step is None or not matcher.consume_token(step[0]):
                    return None
                consumed += 1
                text += step[1]
        finally:
            if consumed:
                matcher.rollback(consumed)
        return bytes(text)

    def _forced(self, matcher) -> tuple[int, bytes] | None:
        """The longest vocabulary token spelling the start of what the grammar forces."""
        forced = matcher.compute_ff_bytes()
        for n in range(min(len(forced), MAX_PIECE_BYTES), 0, -1):
            for token in self.by_bytes.get(forced[:n], ()):
                if matcher.validate_tokens([token]) == 1:
                    return token, forced[:n]
        return None

    def _choose(self, matcher, limit: int, look_ahead: bool) -> tuple[int, bytes] | None:
        """The first byte of CLOSE_ORDER the grammar allows; where that is no closer (a choice
        between enum values, value kinds, anyOf branches), looking ahead: the first few
        allowed bytes are each walked on (without looking further) and the shortest wins."""
        options = self._allowed_bytes(matcher, LOOK_AHEAD_OPTIONS if look_ahead else 1)
        if not options:
            return None
        if len(options) == 1 or options[0][1] in CLOSERS:
            return options[0]
        best, best_len = None, None
        for token, piece in options[:LOOK_AHEAD_OPTIONS]:
            matcher.consume_token(token)
            rest = self._walk(matcher, min(limit, best_len or limit), look_ahead=False)
            matcher.rollback(1)
            if rest is not None and (best_len is None or len(rest) < best_len):
                best, best_len = (token, piece), len(rest)
        return best or options[0]

    def _allowed_bytes(self, matcher, most: int) -> list[tuple[int, bytes]]:
        """Up to `most` single-byte tokens the grammar allows, in CLOSE_ORDER, one digit at
        most (they lead alike); a `"` that would open a string goes just before `{`."""
        options, quote, digit = [], None, False
        for byte in CLOSE_ORDER:
            if len(options) >= most:
                break
            token = self.single.get(byte)
            if token is None or (digit and chr(byte).isdigit()) \
                    or matcher.validate_tokens([token]) != 1:
                continue
            digit = digit or chr(byte).isdigit()
            if byte == ord('"') and self._opens_string(matcher, token):
                quote = (token, b'"')
                continue
            if byte == ord('{') and quote is not None:
                options.append(quote)
                quote = None
            options.append((token, bytes([byte])))
        if quote is not None and len(options) < most:
            options.append(quote)
        return options

    def _opens_string(self, matcher, quote: int) -> bool:
        """Whether `"` here opens a string (a value may follow) rather than closing one: only
        an opened string can be closed by a second `"` right away."""
        return matcher.validate_tokens([quote, quote]) == 2

    def _priced(self, text: bytes, allowed=None) -> ClosePath:
        """costs[i]: the fewest vocabulary tokens spelling text[i:] (right to left), counting
        only the pieces `allowed(i, piece)` (else any the vocabulary has: a bound from below)."""
        n = len(text)
        costs = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            options = [1 + costs[i + k] for k in range(1, min(n - i, MAX_PIECE_BYTES) + 1)
                       if text[i:i + k] in self.by_bytes
                       and (allowed is None or allowed(i, text[i:i + k]))]
            costs[i] = min(options) if options else 1 + costs[i + 1]
        return ClosePath(text, costs, exact=allowed is not None)

    def exact(self, matcher, path: ClosePath) -> ClosePath:
        """The path priced with the tokens the grammar's masks allow along it, from the
        matcher's state (left as it was). The masks can be stricter than what the matcher
        consumes (a token spanning the end of an enum value and a `}`), so a price by bytes
        alone may be short of what the answer can really be written in."""
        from llguidance.numpy import fill_next_token_bitmask
        ids = self.spell(path.text)
        if path.exact or ids is None:
            return path
        masks = np.zeros((len(ids), (len(self.token_bytes) + 31) // 32), np.int32)
        consumed = 0
        try:
            for i, token in enumerate(ids):
                fill_next_token_bitmask(matcher, masks, i)
                if not matcher.consume_token(token):
                    return path
                consumed += 1
        finally:
            if consumed:
                matcher.rollback(consumed)
        bits = masks.view(np.uint32)

        def allowed(i, piece):
            return any((bits[i, t >> 5] >> (t & 31)) & 1 for t in self.by_bytes[piece])
        return self._priced(path.text, allowed)

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

    def steer(self, row: np.ndarray, tokens_left: int, close: ClosePath | None, matcher,
              guard: int, eos_token_ids) -> tuple[ClosePath | None, bool, bool]:
        """Within CLOSE_MARGIN of the close's cost, the row keeps only the tokens on the path
        that leave enough to finish it (EOS once it is closed), among those it allowed; in the
        `guard` tokens before, tokens on the path or holding no structural byte. The path is
        priced by the masks along it (Closer.exact) from the first guarded row on.
        -> (the path, so priced; whether the row was steered to close; whether the path
        needs more tokens than are left)."""
        if close is None or tokens_left > close.tokens_needed + CLOSE_MARGIN + guard:
            return close, False, False
        close = self.exact(matcher, close)
        if tokens_left > close.tokens_needed + CLOSE_MARGIN:
            on_path = _bits(row, self.next_tokens(close, tokens_left)) if close.text \
                else _bits(row, eos_token_ids)
            guarded = row & (on_path | self.plain_bits)
            if guarded.any():
                row[:] = guarded
            return close, False, False
        ids = self.next_tokens(close, tokens_left) if close.text else eos_token_ids
        keep = _bits(row, ids) & row
        if close.text and not keep.any():     # (no piece the grammar takes: its first byte)
            keep = _bits(row, self.spell(close.text[:1]) or []) & row
        if keep.any():                        # (never an empty row)
            row[:] = keep
        return close, True, close.tokens_needed > tokens_left


def _bits(row: np.ndarray, ids) -> np.ndarray:
    """The mask row (int32 words) allowing exactly `ids`."""
    bits = np.zeros(row.shape[0], np.uint32)
    for t in ids:
        bits[t >> 5] |= np.uint32(1 << (t & 31))
    return bits.view(np.int32)
