"""Incremental detokenization and stop strings: O(1) amortised work per generated token.

Why not decode the whole output every step: that is O(n) per token, O(n^2) per request, and at
a few thousand tokens it costs more host time than the decode step itself. Instead each
completion keeps two offsets into its output token ids (the scheme of vLLM's
`detokenize_incrementally`):

    ids:  ... | prefix window |  new tokens  |
              ^prefix         ^read          ^len(ids)

and decodes only `ids[prefix:]` and `ids[prefix:read]`; the new text is the first minus the
second. Decoding from `prefix` rather than `read` keeps context that some decoders need (a
SentencePiece decoder strips the leading space of the first token it sees; it strips it from
both decodes alike). Both offsets sit on character boundaries, so each window decodes to exactly
its slice of the full text, and the concatenation equals `tokenizer.decode(all ids)`.

Half a UTF-8 character is never emitted: a byte-level token can carry the first bytes of a
character whose remaining bytes arrive with the next token; the decoder renders the incomplete
tail as U+FFFD. While the window ends in U+FFFD the offsets do not move; the complete characters
before that tail are emitted (so a stop string that ends there is seen at once, exactly as a
full re-decode would see it) and the tail waits. At the end of a request the tail is flushed
as the full decode would render it.

Stop strings: an occurrence not found last step must end in the new text, so only the new text
plus max(len(stop)) - 1 characters before it are searched. For streaming, `output_text()` of an
unfinished completion holds back its last max(len(stop)) - 1 characters, which might be the
first part of a stop string that the next token completes; a client never sees them unless the
request ends without that stop string.

Host-side only: imports no JAX.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


def _decoder(tokenizer, skip_special_tokens: bool):
    """The cheapest call that gives the same text as `tokenizer.decode(ids, skip_special_tokens)`.
    A Hugging Face fast tokenizer's Rust backend skips transformers' Python wrapper (several
    times slower on short windows); its result is the same unless the tokenizer cleans up
    tokenization spaces, in which case we go through `decode` itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of one completion, grown token by token.

    `update(token_ids)` takes the completion's whole (growing) list of output ids, decodes only
    what is new and returns the stop string it matched, if any. `text` is everything decoded so
    far (without a trailing incomplete character; cut before a matched stop string);
    `output_text(finished)` is what may be shown now.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop=None):
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.stop = list(stop or [])
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_reason: str | None = None   # the stop string matched, once matched
        self.flushed = False
        self._seen = 0            # output ids consumed so far
        self._prefix = 0          # start of the decode window (a character boundary)
        self._read = 0            # ids before this are fully emitted (a character boundary)
        self._prefix_text = ""    # decode(ids[_prefix:_read]), kept from when _read moved
        self._extra = 0           # characters emitted from ids past _read (before a U+FFFD tail)

    @property
    def num_seen(self) -> int:
        """Output ids consumed so far."""
        return self._seen

    def update(self, token_ids, final: bool = False) -> str | None:
        """Consume `token_ids[self._seen:]`. `final=True` (the completion has ended) also flushes
        an incomplete trailing character. Returns the stop string matched now, else None."""
        if self.stop_reason is not None or self.flushed:
            return None
        n = len(token_ids)
        if n <= self._seen and not final:
            return None
        self._seen = n
        delta = self._step(token_ids, n, final)
        self.flushed = final
        if not delta:
            return None
        searched = len(self.text)
        self.text += delta
        return self._find_stop(searched) if self.stop else None

    def _step(self, token_ids, n: int, final: bool) -> str:
        full = self._decode(token_ids[self._prefix:n])
        done = len(self._prefix_text) + self._extra    # characters of `full` already emitted
        if full.endswith(REPLACEMENT) and not final:
            # Possibly the first bytes of a character: emit what precedes them, keep the window.
            new = full.rstrip(REPLACEMENT)[done:]
            self._extra += len(new)
            return new
        self._prefix, self._read, self._extra = self._read, n, 0
        self._prefix_text = self._decode(token_ids[self._prefix:n])
        return full[done:]

    def _find_stop(self, searched: int) -> str | None:
        # The earliest occurrence wins, the smaller string on a tie (as a full-text search with
        # min((index, stop)) does). Earlier text was searched on earlier steps.
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(0, searched - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        self.stop_reason = stop
        return stop

    def output_text(self, finished: bool) -> str:
        """The text a caller may show now. Finished: all of it (the matched stop string
        excluded). Unfinished: without the last max(len(stop)) - 1 characters, which could
        still turn out to begin a stop string."""
        if finished or self.stop_reason is not None or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
