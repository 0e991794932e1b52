"""The engine's one seam for structured outputs: a matcher per constrained sequence, advanced
with the tokens the scheduler appends, and the packed bitmask of a call's sampling rows.

Lifecycle, as the engine drives it:
  check(params)          in validate_request: compiles (cached by grammar text), ValueError with
                         llguidance's message; changes nothing
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
from jaxbatch.structured.grammar import grammar_for

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


def _mask_threads() -> int:
    """Half the cores we may use, at most 8: the rest dispatch steps and serve HTTP (one on
    a 2-core CI machine, where a second thread only contends)."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 2) // 2))


class _SeqMatcher:
    def __init__(self, matcher, phase=None):
        self.matcher = matcher
        self.consumed = 0           # output tokens read (fed to the matcher once answering)
        self.phase = phase          # reasoning: the output's phase (None: no reasoning parser)

    @property
    def answering(self) -> bool:
        return self.phase is None or self.phase is Phase.ANSWER


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 reasoning=None):
        """`vocab_size`: the logits' width (the mask's; ids the tokenizer lacks are banned).
        `reasoning`: the engine's ReasoningParser (jaxbatch/reasoning/), or None: grammars
        then apply from the first output token."""
        self.reasoning = reasoning
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None      # llguidance's, built on the first grammar (0.4-1.2 s)
        self._executor = None
        self._building = threading.Lock()
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._seqs: dict[int, _SeqMatcher] = {}
        self.compile_seconds = 0.0   # tokenizer build + grammar compiles
        self.mask_seconds = 0.0      # advancing matchers + filling masks
        self.num_mask_fills = 0      # model calls that carried a bitmask
        self.num_overlapped_fills = 0  # of which filled while their forward ran (engine's count)
        self.num_rejected_tokens = 0  # tokens a matcher refused (a bug if ever > 0)

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
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor(num_threads=_mask_threads())
                self.compile_seconds += time.perf_counter() - start
        return self._tokenizer

    # ---- requests --------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """ValueError (llguidance's message) if the request's grammar does not compile."""
        if params.structured_outputs is not None:
            self._compile(params)

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
            self._seqs[seq.seq_id] = _SeqMatcher(self._compile(seq.params).deep_copy(), phase)
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
                "structured_num_rejected_tokens": self.num_rejected_tokens}

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
        state.consumed = end
        self.mask_seconds += time.perf_counter() - start

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        state = self._seqs.get(seq_id)
        if state is not None and num_tokens:
            state.matcher.rollback(num_tokens)
            state.consumed -= num_tokens

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
        live = []
        for seq_id, items in by_seq.items():
            matcher = self._seqs[seq_id].matcher
            if matcher.is_error():
                for _, i in items:        # only EOS: it ends rather than wander off its grammar
                    bitmask[i] = 0
                    for eos in self.eos_token_ids:
                        _allow(bitmask, i, eos)
            elif not self._seqs[seq_id].answering:
                self._fill_gated_rows(self._seqs[seq_id], sorted(items),
                                      (drafts or {}).get(seq_id, []), bitmask,
                                      fill_next_token_bitmask)
            elif len(items) == 1:
                live.append((matcher, items[0][1]))
            else:
                self._fill_verification_rows(matcher, sorted(items), (drafts or {}).get(seq_id, []),
                                             bitmask, fill_next_token_bitmask)
        if live:
            fill_next_token_bitmask_par(self._executor, live, bitmask)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_fills += 1
        return bitmask

    def _fill_gated_rows(self, state, items, draft, bitmask, fill) -> None:
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
            self._fill_verification_rows(state.matcher, items[answer_from:], draft[answer_from:],
                                         bitmask, fill)

    @staticmethod
    def _fill_verification_rows(matcher, items, draft, bitmask, fill) -> None:
        """Row j (position base + j) samples after draft[:j]: the matcher consumes the drafts
        tentatively and rolls them back. Rows past the first proposal the grammar refuses keep
        all ones: the row before them samples under the grammar, so that proposal is rejected
        there and they are discarded."""
        base, valid, consumed = items[0][0], matcher.validate_tokens(draft), 0
        for position, i in items:
            j = position - base
            if j > valid:
                break
            while consumed < j:
                matcher.consume_token(draft[consumed])
                consumed += 1
            fill(matcher, bitmask, i)
        if consumed:
            matcher.rollback(consumed)

    def is_answering(self, seq_id: int) -> bool:
        """Whether the sequence's grammar applies now (always, without a reasoning parser)."""
        return self._seqs[seq_id].answering

    def is_allowed(self, seq_id: int, token_id: int) -> bool:
        """Whether the sequence's matcher allows `token_id` next (tests, debugging)."""
        bitmask = np.zeros((1, self.words), np.int32)
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self._seqs[seq_id].matcher, bitmask, 0)
        return bool((bitmask[0, token_id >> 5] >> (token_id & 31)) & 1)


def _allow(bitmask: np.ndarray, row: int, token: int) -> None:
    bitmask[row].view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))
