"""The engine's one seam for structured outputs: a matcher per constrained sequence, advanced
with the tokens the scheduler appends, and the packed bitmask of a call's sampling rows.

Lifecycle, as the engine drives it:
  check(params, n)       in validate_request: compiles (cached by grammar text), ValueError with
                         llguidance's message, or naming max_tokens when the shortest answer
                         the grammar accepts needs more tokens than an n-token prompt leaves;
                         changes nothing
  add(seq)               after the request's sequences exist: a copy of the compiled matcher each
  advance(seq)           after Scheduler.update: feeds the output tokens not yet consumed
  fill_bitmask(rows)     while the step's forwards run, per sampled part: [rows, ceil(V/32)]
                         int32, or None when no row of the part has a grammar; the engine hands
                         the masks to the runner's sampling as data
  remove(seq_id)         when the request ends or is aborted

Reasoning models (an engine with a reasoning parser, jaxbatch/reasoning/): the grammar starts
after the thought. A sequence's gate follows its output's phase token by token (thinking, maybe
about to think, answering); its matcher consumes only the answer's tokens, and its rows carry
no constraint while it thinks (the grammar's mask plus the opening tag while "maybe"), so the
thought is free and the answer still follows the grammar.

Matchers count the output tokens they consumed, so a recompute preemption (which keeps the
tokens) feeds nothing twice. With host/device overlap, a step with grammar rows is planned and
its forwards dispatched before the previous step is read; the engine then reads it, advances
the matchers and fills the masks (LLMEngine._dispatch), so only the sampling waits. Speculation: each
verification row's mask comes from the matcher advanced over the proposals before it and rolled
back at once; the accepted ones are consumed when the scheduler appends them (`advance`), so
rejected proposals never reach the matcher.

Closing within the budget (closing.py): each sequence keeps a closing path from its matcher's
state (kept while its tokens lie on it or leave it intact, found again otherwise). Once the
tokens left are within closing.CLOSE_MARGIN of what the path costs, its row allows only tokens on the
path that leave enough tokens to finish it, so the answer closes by max_tokens; in a guard
window before that, no structural token off the path (nothing new is opened). The masks stay
data of the sequence alone: batch-invariant, nothing compiled.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from jaxbatch.core.plan import PENDING_TOKEN, SamplingRow
from jaxbatch.reasoning.parser import Phase
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.structured.closing import ClosePath, Closer
from jaxbatch.structured.grammar import grammar_for

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# Before that, for as many tokens as the grammar's shortest answer, nothing new is opened: a
# token holding a structural byte (Closer.STRUCTURAL) is allowed only on the path. One `,`
# can open a whole new item (a second tool call) that costs about as much as a whole answer.


def _mask_threads() -> int:
    """Half the cores we may use, at most 8: the rest dispatch steps and serve HTTP (one on
    a 2-core CI machine, where a second thread only contends)."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 2) // 2))


class _SeqMatcher:
    def __init__(self, matcher, budget: int, shortest: int, phase=None):
        self.matcher = matcher
        self.shortest = shortest    # tokens of the grammar's shortest answer (the guard's width)
        self.consumed = 0           # output tokens read (fed to the matcher once answering)
        self.budget = budget        # output tokens the sequence may have in all, thought included
        self.close: ClosePath | None = None   # from the matcher's state; None: find it again
        self.no_close_at = -1       # `consumed` where the last search found none
        self.phase = phase          # reasoning: the output's phase (None: no reasoning parser)

    @property
    def answering(self) -> bool:
        return self.phase is None or self.phase is Phase.ANSWER


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_model_len: int | None = None, reasoning=None):
        """`vocab_size`: the logits' width (the mask's; ids the tokenizer lacks are banned).
        `max_model_len`: with max_tokens, what bounds a sequence's output (its budget).
        `reasoning`: the engine's ReasoningParser (jaxbatch/reasoning/), or None: grammars
        then apply from the first output token."""
        self.reasoning = reasoning
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self._tokenizer = None      # llguidance's, built on the first grammar (0.4-1.2 s)
        self._closer: Closer | None = None    # (with the tokenizer)
        self._shortest: dict[str, int | None] = {}   # grammar -> tokens of its shortest close
        self._executor = None
        self._building = threading.Lock()
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._seqs: dict[int, _SeqMatcher] = {}
        self.compile_seconds = 0.0   # tokenizer build + grammar compiles
        self.mask_seconds = 0.0      # advancing matchers + filling masks
        self.num_mask_fills = 0      # model calls that carried a bitmask
        self.num_overlapped_fills = 0  # of which filled while their forward ran (engine's count)
        self.num_rejected_tokens = 0  # tokens a matcher refused (a bug if ever > 0)
        self.num_closing_rows = 0    # rows steered to close within the budget
        self.num_close_overshoots = 0  # of which the close no longer fit (a token jumped past
                                       # CLOSE_MARGIN; the answer is cut: a bug if ever > 0)

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def prepare_in_background(self) -> None:
        """Builds llguidance's tokenizer on a thread of its own (a server calls this once the
        engine is up), so the first grammar request does not stall every stream for it."""
        if self._hf_tokenizer is not None:
            threading.Thread(target=self._ll_tokenizer, name="llguidance-tokenizer",
                             daemon=True).start()

    def _ll_tokenizer(self):
        with self._building:
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this engine has none")
                import llguidance
                import llguidance.hf
                start = time.perf_counter()
                tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                ids = range(tokenizer.vocab_size)
                self._closer = Closer([tokenizer.decode_bytes([i]) for i in ids],
                                      {i for i in ids if tokenizer.is_special_token(i)})
                self._tokenizer = tokenizer
                self._executor = llguidance.LLExecutor(num_threads=_mask_threads())
                self.compile_seconds += time.perf_counter() - start
        return self._tokenizer

    # ---- requests --------------------------------------------------------------------------
    def check(self, params: SamplingParams, num_prompt_tokens: int | None = None) -> None:
        """ValueError if the request's grammar does not compile (llguidance's message), or if
        its shortest answer needs more tokens than max_tokens (and max_model_len) allow."""
        if params.structured_outputs is None:
            return
        matcher = self._compile(params)
        budget = self._budget(params, num_prompt_tokens)
        shortest = self._shortest_answer(params, matcher)
        if budget is not None and shortest is not None and budget < shortest:
            if params.max_tokens is not None and params.max_tokens < shortest:
                raise ValueError(
                    f"SamplingParams.max_tokens={params.max_tokens} is too small for the "
                    f"structured output: its shortest valid answer takes {shortest} tokens")
            raise ValueError(
                f"SamplingParams.max_tokens: a prompt of {num_prompt_tokens} tokens leaves "
                f"{budget} of max_model_len={self.max_model_len}, fewer than the {shortest} "
                f"tokens the structured output's shortest valid answer takes")

    def _budget(self, params: SamplingParams, num_prompt_tokens: int | None) -> int | None:
        """Output tokens a sequence may have: max_tokens, and what max_model_len leaves."""
        limits = [params.max_tokens] if params.max_tokens is not None else []
        if self.max_model_len is not None and num_prompt_tokens is not None:
            limits.append(self.max_model_len - num_prompt_tokens)
        return min(limits) if limits else None

    def shortest_answer(self, params: SamplingParams) -> int | None:
        """Tokens the shortest answer the request's grammar accepts takes, as far as the
        closing walk finds one (None: no grammar, or no close found): the least max_tokens
        `check` lets through."""
        if params.structured_outputs is None:
            return None
        return self._shortest_answer(params, self._compile(params))

    def _shortest_answer(self, params: SamplingParams, matcher) -> int | None:
        """Tokens of the closing path from the grammar's start (None: no close found)."""
        grammar = grammar_for(params.structured_outputs)
        if grammar not in self._shortest:
            matcher = matcher.deep_copy()
            path = self._closer.find(matcher)
            self._shortest[grammar] = (None if path is None
                                       else self._closer.exact(matcher, path).tokens_needed)
            if len(self._shortest) > MAX_CACHED_GRAMMARS:
                del self._shortest[next(iter(self._shortest))]
        return self._shortest[grammar]

    def _compile(self, params: SamplingParams):
        from llguidance import LLMatcher
        grammar = grammar_for(params.structured_outputs)
        matcher = self._compiled.get(grammar)
        if matcher is not None:
            self._compiled.move_to_end(grammar)
            return matcher
        tokenizer = self._ll_tokenizer()
        start = time.perf_counter()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.compile_seconds += time.perf_counter() - start
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def add(self, seq) -> None:
        if seq.params.structured_outputs is not None:
            phase = None
            if self.reasoning is not None:
                phase = self.reasoning.first_phase(seq.prompt_token_ids, self._decode)
            budget = self._budget(seq.params, seq.num_prompt_tokens)
            self._seqs[seq.seq_id] = _SeqMatcher(self._compile(seq.params).deep_copy(),
                                                 budget if budget is not None else 1 << 30,
                                                 self.shortest_answer(seq.params) or 0, phase)
            self.advance(seq)     # (a sequence given with output tokens already)

    def _decode(self, ids: list[int]) -> str:
        return self._hf_tokenizer.decode(ids)

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def stats(self) -> dict:
        """For LLMEngine.stats(): host seconds, and mask seconds / fills = per model call."""
        return {"structured_compile_seconds": self.compile_seconds,
                "structured_mask_seconds": self.mask_seconds,
                "structured_num_mask_fills": self.num_mask_fills,
                "structured_num_overlapped_fills": self.num_overlapped_fills,
                "structured_num_sequences": self.num_sequences,
                "structured_num_rejected_tokens": self.num_rejected_tokens,
                "structured_num_closing_rows": self.num_closing_rows,
                "structured_num_close_overshoots": self.num_close_overshoots}

    # ---- the step --------------------------------------------------------------------------
    def advance(self, seq) -> None:
        """Feeds the sequence's read output tokens the matcher has not consumed yet."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        start = time.perf_counter()
        out = seq.output_token_ids
        end = state.consumed
        while end < len(out) and out[end] != PENDING_TOKEN:
            end += 1
        for token in out[state.consumed:end]:
            if not state.answering:          # the thought: read by the gate, not the grammar
                before, state.phase = state.phase, self.reasoning.next_phase(state.phase, token)
                if not (state.answering and before is Phase.MAYBE):
                    continue                 # (an answer that begins without a thought: fed)
            if not state.matcher.consume_token(token):
                self.num_rejected_tokens += 1
                logger.error("sequence %d: the grammar refused token %d: %s", seq.seq_id, token,
                             state.matcher.get_error())
            self._follow_close(state, token)
        state.consumed = end
        self.mask_seconds += time.perf_counter() - start

    def _follow_close(self, state: _SeqMatcher, token: int) -> None:
        """The closing path after `token`, one token at a time (so the same tokens give the
        same paths however the steps group them): the rest of it if the token lay on it,
        the same if it still closes, else found again when next needed."""
        if state.close is None:
            return
        piece = self._closer.token_bytes[token] if token < len(self._closer.token_bytes) else b""
        rest = state.close.after(piece) if piece else None
        if rest is None and not self._closer.keeps(state.matcher, state.close):
            state.close = None
        elif rest is not None:
            state.close = rest

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        state = self._seqs.get(seq_id)
        if state is not None and num_tokens:
            state.matcher.rollback(num_tokens)
            state.consumed -= num_tokens
            state.close = None

    def fill_bitmask(self, rows: list[SamplingRow | None],
                     drafts: dict[int, list[int]] | None = None) -> np.ndarray | None:
        """[len(rows), ceil(V/32)] int32: all ones for rows without a grammar; None if no row
        has one (the sampler then keeps its mask on device). `drafts[seq_id]`: speculative
        proposals; the sequence's verification rows (positions after its first row) get the
        masks of its grammar after the proposals before them."""
        by_seq: dict[int, list[tuple[int, int]]] = {}
        for i, r in enumerate(rows):
            if r is not None and r.seq_id in self._seqs:
                by_seq.setdefault(r.seq_id, []).append((r.position, i))
        if not by_seq:
            return None
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
        start = time.perf_counter()
        bitmask = np.full((len(rows), self.words), -1, np.int32)
        live, steered = [], []
        for seq_id, items in by_seq.items():
            state = self._seqs[seq_id]
            matcher = state.matcher
            if matcher.is_error():
                for _, i in items:        # only EOS: it ends rather than wander off its grammar
                    bitmask[i] = 0
                    for eos in self.eos_token_ids:
                        _allow(bitmask, i, eos)
            elif not state.answering:
                self._fill_gated_rows(state, sorted(items), rows, (drafts or {}).get(seq_id, []),
                                      bitmask, fill_next_token_bitmask)
            elif len(items) == 1:
                live.append((matcher, items[0][1]))
                steered.append((state, rows[items[0][1]], items[0][1]))
            else:
                self._fill_verification_rows(state, sorted(items), rows,
                                             (drafts or {}).get(seq_id, []),
                                             bitmask, fill_next_token_bitmask)
        if live:
            fill_next_token_bitmask_par(self._executor, live, bitmask)
        for state, row, i in steered:
            state.close = self._steer(bitmask[i], self._tokens_left(state, row),
                                      self._close_of(state), state.matcher, state.shortest)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_fills += 1
        return bitmask

    def _fill_gated_rows(self, state, items, rows, draft, bitmask, fill) -> None:
        """Rows of a sequence still before its answer: row j samples after draft[:j]. Rows in
        the thought stay all ones; a "maybe" row gets the grammar's mask plus the opening tag;
        rows past the draft's end of thought get the grammar after the answer's drafts."""
        phase, answer_from, phases = state.phase, None, []
        for j in range(len(items)):
            phases.append(phase)
            if j < len(draft) and answer_from is None:
                before, phase = phase, self.reasoning.next_phase(phase, draft[j])
                if phase is Phase.ANSWER:
                    answer_from = j if before is Phase.MAYBE else j + 1
        for (_, i), row_phase in zip(items, phases):
            if row_phase is Phase.MAYBE:
                fill(state.matcher, bitmask, i)
                _allow(bitmask, i, self.reasoning.start_id)
        if answer_from is not None and answer_from < len(items):
            self._fill_verification_rows(state, items[answer_from:], rows, draft[answer_from:],
                                         bitmask, fill)

    def _fill_verification_rows(self, state, items, rows, draft, bitmask, fill) -> None:
        """Row j (position base + j) samples after draft[:j]: the matcher consumes the drafts
        tentatively and rolls them back. Rows past the first proposal the grammar refuses keep
        all ones: the row before them samples under the grammar, so that proposal is rejected
        there and they are discarded. Each row is steered to close as a plain decode there
        would be (its closing path found from the drafted state)."""
        matcher = state.matcher
        base, valid, consumed = items[0][0], matcher.validate_tokens(draft), 0
        for position, i in items:
            j = position - base
            if j > valid:
                break
            while consumed < j:
                matcher.consume_token(draft[consumed])
                consumed += 1
            fill(matcher, bitmask, i)
            tokens_left = self._tokens_left(state, rows[i])
            if j == 0:
                state.close = self._steer(bitmask[i], tokens_left, self._close_of(state), matcher,
                                          state.shortest)
            else:
                self._steer(bitmask[i], tokens_left, self._closer.find(matcher), matcher,
                            state.shortest)
        if consumed:
            matcher.rollback(consumed)

    def is_answering(self, seq_id: int) -> bool:
        """Whether the sequence's grammar applies now (always, without a reasoning parser)."""
        return self._seqs[seq_id].answering

    # ---- closing within the budget ---------------------------------------------------------
    @staticmethod
    def _tokens_left(state: _SeqMatcher, row: SamplingRow) -> int:
        """Tokens the sequence may still write, the one this row samples included."""
        return state.budget - (row.position - row.num_prompt_tokens)

    def _close_of(self, state: _SeqMatcher) -> ClosePath | None:
        if state.close is None and state.no_close_at != state.consumed:
            state.close = self._closer.find(state.matcher)
            if state.close is None:
                state.no_close_at = state.consumed
        return state.close

    def _steer(self, row: np.ndarray, tokens_left: int, close: ClosePath | None,
               matcher, guard: int) -> ClosePath | None:
        """`Closer.steer`, counted in the stats."""
        close, closing, overshoot = self._closer.steer(row, tokens_left, close, matcher, guard,
                                                       self.eos_token_ids)
        self.num_closing_rows += closing
        self.num_close_overshoots += overshoot
        return close


    def is_allowed(self, seq_id: int, token_id: int) -> bool:
        """Whether the sequence's matcher allows `token_id` next (tests, debugging)."""
        bitmask = np.zeros((1, self.words), np.int32)
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self._seqs[seq_id].matcher, bitmask, 0)
        return bool((bitmask[0, token_id >> 5] >> (token_id & 31)) & 1)


def _allow(bitmask: np.ndarray, row: int, token: int) -> None:
    bitmask[row].view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))
