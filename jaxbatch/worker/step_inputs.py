"""Host side of the runner: which shape buckets exist, and how a `StepPlan` is laid out as the
numpy arrays of each compiled call. No device work happens here.

An engine step makes at most two kinds of model call, or a mixed call holding both:
  decode   one token for each decoding sequence, rows padded to a power of two (at least
           MIN_DECODE_ROWS, at most next_power_of_two(max_num_seqs)): a half-empty slot array
           should not pay for the empty half (our CPU GEMMs leave padding rows out,
           `decoder.padding_start`, but every other op computes them).
           Attention inputs: the xla backend's work items, sized for the longest contexts
           the rows can have (its attention loops over the items in use at run time, so the
           key is rows only); the other backends' block tables, padded to a page bucket.
  prefill  the step's prefill chunks packed into one call (more only when they overflow the
           largest token bucket or the backend's chunks_per_call), each starting on a
           multiple of the backend's `prefill_align` (1: back to back), tokens padded to a
           bucket; xla's tile tables span max_pages_per_seq (its attention stops at the
           call's last position), the others' block tables a page bucket.
  mixed    with `unified` (the `unified_step` option, on backends with `mixed_calls`): a step
           whose decode rows fill the largest row bucket runs them and its (first) prefill
           call as one call, decode rows first, then the packed prefill tokens: one pass over
           the weights instead of two. Each part keeps its own attention arrays and its own
           sampling (`ModelCall.parts`); the key is ("mixed", rows, items, tokens, pages),
           one per prefill token bucket. Only the largest row bucket: a busy engine admits
           beside a full decode batch, and smaller ones would multiply the executables to
           compile and run at warm-up by the number of row buckets.
Buckets are powers of two (and, for xla's prefill tokens, steps between them), so the set of
shapes is small and known (`bucket_shapes`).
Block ids in every array are layer 0's; the model shifts them per layer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxbatch.core.config import SchedulerConfig, next_power_of_two
from jaxbatch.core.plan import PENDING_TOKEN, PrefillChunk, SamplingRow, StepPlan, pad_block_table
from jaxbatch.worker.attention.base import AttentionBackend
from jaxbatch.worker.executable_keys import ModelCallKey, SampleKey
from pallas_kernels.xla_paged_attention import PAGES_PER_ITEM

MIN_PREFILL_BUCKET = 16
# Batch invariance: XLA:CPU's dot sums a row in another order when the call has 1 or 2 rows
# than when it has 3 or more (bf16 x bf16 -> f32; float32 switches at 1 row), and in bf16 the
# next activation's rounding turns that last-bit difference into a different logprob. From 3
# rows up a row's result no longer depends on the row count, so no call has fewer.
MIN_DECODE_ROWS = 4
MAX_PREFILL_BUCKET = 1024   # unless one chunk is larger
# Block-table backends (pallas, reference): prefill calls attend over at least this many keys
# (whole pages), for fewer (tokens, pages) executables to compile.
MIN_PREFILL_CONTEXT = 64


@dataclasses.dataclass
class ModelCall:
    """One model call: its bucket key, its step inputs (params and pool are added at dispatch),
    the sampling row of each sampled row, and, for prefill, where each chunk sits."""
    # decode (rows, items or pages) | prefill (tokens, pages) | mixed: a decode key's sizes,
    # then a prefill key's
    key: ModelCallKey
    args: tuple
    rows: list[SamplingRow | None]
    chunks: list[PrefillChunk] = dataclasses.field(default_factory=list)
    q_starts: list[int] = dataclasses.field(default_factory=list)   # row of each chunk in the call
    targets: np.ndarray | None = None   # prefill: the token after each position, -1 if none
    want_prompt_logprobs: bool = False
    # decode: (seq_id, j) of each row; j = 0 its token, j >= 1 its j-th proposed token
    decode_rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # decode with sampled drafts: (draft_token [rows] i32, q [rows, V] f32), see `verify_inputs`
    verify: tuple[np.ndarray, np.ndarray] | None = None
    # The slot each sampled row's token is kept under on device (max_num_seqs: not kept), so
    # the next step can decode it before the host has read it (host/device overlap).
    token_slots: np.ndarray | None = None
    # mixed: (its decode call, its prefill call), each sampled and read back as if run alone
    parts: tuple["ModelCall", "ModelCall"] | None = None


class StepLayout:
    def __init__(self, cfg: SchedulerConfig, backend: AttentionBackend, unified: bool = False):
        """`backend`: the attention backend whose metadata each call carries
        (`worker/attention/`): it decides the calls' attention arrays and their shape keys.
        `unified`: decode rows and a prefill call of the same step share one model call,
        where the backend's `mixed_calls` allows it."""
        self.cfg = cfg
        self.backend = backend
        self.chunks_per_call = backend.chunks_per_call
        self.unified = unified and backend.mixed_calls

    # ---- buckets -------------------------------------------------------------------------
    @property
    def max_page_bucket(self) -> int:
        return next_power_of_two(self.cfg.max_pages_per_seq)

    def page_bucket(self, num_pages: int) -> int:
        return min(next_power_of_two(max(1, num_pages)), self.max_page_bucket)

    @property
    def max_items_per_seq(self) -> int:
        return -(-self.cfg.max_pages_per_seq // PAGES_PER_ITEM)

    @property
    def max_decode_items(self) -> int:
        return next_power_of_two(self.cfg.max_num_seqs * self.max_items_per_seq)

    def decode_item_capacity(self, rows: int) -> int:
        """Work items of a decode call of `rows` rows: room for every row at full length."""
        return min(next_power_of_two(rows * self.max_items_per_seq), self.max_decode_items)

    def decode_row_bucket(self, num_decodes: int) -> int:
        largest = max(MIN_DECODE_ROWS, next_power_of_two(self.cfg.max_num_seqs))
        return min(max(MIN_DECODE_ROWS, next_power_of_two(num_decodes)), largest)

    @property
    def max_prefill_tokens(self) -> int:
        """Largest packed prefill call: what the token budget allows, kept to a size whose
        attention scores fit comfortably, but never below one whole chunk."""
        budget_pow2 = 1 << (self.cfg.max_num_batched_tokens.bit_length() - 1)
        return max(MIN_PREFILL_BUCKET, self.cfg.prefill_chunk_size,
                   min(budget_pow2, MAX_PREFILL_BUCKET))

    def prefill_bucket(self, num_tokens: int) -> int:
        """The smallest token bucket that holds num_tokens (the largest if none does)."""
        buckets = self.prefill_token_buckets()
        return next((t for t in buckets if t >= num_tokens), buckets[-1])

    def prefill_page_bucket(self, tokens_bucket: int, num_pages: int) -> int:
        """At least the pages the call's tokens would span (a few more keys for calls packing
        short prompts, and half as many (tokens, pages) executables to compile), and at least
        MIN_PREFILL_CONTEXT keys."""
        floor = max(1, MIN_PREFILL_CONTEXT // self.cfg.block_size)
        return self.page_bucket(max(num_pages, tokens_bucket // self.cfg.block_size, floor))

    def decode_row_buckets(self) -> list[int]:
        last = self.decode_row_bucket(self.cfg.max_num_seqs)
        return [1 << i for i in range(last.bit_length()) if 1 << i >= MIN_DECODE_ROWS]

    def prefill_token_buckets(self) -> list[int]:
        """Powers of two from MIN_PREFILL_BUCKET, and from 32 the steps between them that the
        backend asks for (`prefill_bucket_quarters`): the xla backend, with one executable
        per token bucket and none per context, has 1.5x (48, 96, ...) where it starts chunks
        on tiles, and quarter steps (40, 48, 56, 64, 80, ...) where it packs them back to
        back: from 32 up, a call's bucket is at most 1.5x its tile-aligned tokens, or 1.25x
        its packed ones, instead of 2x."""
        t, out = MIN_PREFILL_BUCKET, []
        while t <= self.max_prefill_tokens:
            out.append(t)
            if t >= 32:
                out += [t * q // 4 for q in self.backend.prefill_bucket_quarters
                        if t * q // 4 <= self.max_prefill_tokens]
            t *= 2
        return out

    def bucket_shapes(self) -> list[ModelCallKey]:
        """Every model-call shape the scheduler can produce with these settings, whatever the
        requests ask for (penalties and logprobs are runtime branches, not shapes)."""
        shapes = []
        for rows in self.decode_row_buckets():
            shapes += [ModelCallKey.decode(rows, size)
                       for size in self.backend.decode_sizes(self, rows)]
        for t in self.prefill_token_buckets():
            shapes += [ModelCallKey.prefill(t, p) for p in self.backend.prefill_sizes(self, t)]
        if self.unified:
            rows = self.decode_row_buckets()[-1]
            decodes = [k for k in shapes if k.kind == "decode" and k.rows == rows]
            prefills = [k for k in shapes if k.kind == "prefill"]
            shapes += [ModelCallKey.mixed(d, p) for d in decodes for p in prefills]
        return shapes

    def executable_keys(self) -> list[ModelCallKey | SampleKey]:
        """The model calls' shapes, then the sampler's ("sample", rows: a decode row bucket or
        a prefill call's `chunks_per_call`) and ("prompt_logprobs", prefill tokens)."""
        sample_rows = sorted(set(self.decode_row_buckets()) | {self.chunks_per_call})
        return (self.bucket_shapes() + [SampleKey("sample", n) for n in sample_rows]
                + [SampleKey("prompt_logprobs", t) for t in self.prefill_token_buckets()])

    # ---- decode --------------------------------------------------------------------------
    def decode_call(self, plan: StepPlan) -> ModelCall:
        """Decoding sequences take rows in plan order, each followed by a row per proposed
        token (speculation; the scheduler keeps the total within max_num_seqs, so no new
        shapes); padding rows write into the null block and have length 0."""
        bs = self.cfg.block_size
        entries = []          # (seq_id, j, token, position, block table, sampling row)
        for d in plan.decodes:
            entries.append((d.seq_id, 0, d.token_id, d.position, d.block_table,
                            plan.sampling[d.seq_id]))
            for j, (token, row) in enumerate(zip(d.draft_token_ids,
                                                 plan.draft_sampling.get(d.seq_id, ())), 1):
                entries.append((d.seq_id, j, token, d.position + j, d.block_table, row))
        b = self.decode_row_bucket(len(entries))
        tokens = np.zeros(b, np.int32)
        token_src = np.full(b, -1, np.int32)        # >= 0: take the token kept in this slot
        token_slots = np.full(b, self.cfg.max_num_seqs, np.int32)
        positions = np.zeros(b, np.int32)
        slot_mapping = np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)             # 0 = padding row
        rows: list[SamplingRow | None] = [None] * b
        slot_of = {d.seq_id: d.slot for d in plan.decodes}
        for i, (seq_id, j, token, position, table, row) in enumerate(entries):
            if token == PENDING_TOKEN:
                token_src[i] = slot_of[seq_id]
            else:
                tokens[i] = token
            if j == 0:
                token_slots[i] = slot_of[seq_id]
            positions[i] = position
            slot_mapping[i] = table[position // bs] * bs + position % bs
            lengths[i] = position + 1
            rows[i] = row
        meta, size = self.backend.decode_metadata(self, entries, b, lengths)
        return ModelCall(ModelCallKey.decode(b, size), (tokens, token_src, positions, slot_mapping, meta),
                         rows, decode_rows=[(e[0], e[1]) for e in entries],
                         token_slots=token_slots, verify=verify_inputs(plan.decodes, b))

    # ---- prefill -------------------------------------------------------------------------
    def pack_prefills(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        """Greedy, in plan order: chunks join a call while its aligned tokens fit."""
        align = self.backend.prefill_align
        calls, current, used = [], [], 0
        for chunk in chunks:
            size = -(-len(chunk.token_ids) // align) * align
            if current and (used + size > self.max_prefill_tokens
                            or len(current) == self.chunks_per_call):
                calls.append(current)
                current, used = [], 0
            current.append(chunk)
            used += size
        return calls + ([current] if current else [])

    def prefill_call(self, chunks: list[PrefillChunk], plan: StepPlan,
                     next_tokens: dict[int, int]) -> ModelCall:
        """`next_tokens[seq_id]`: the token after a chunk (for prompt logprobs), -1 if none."""
        bs, align = self.cfg.block_size, self.backend.prefill_align
        q_starts, used = [], 0
        for chunk in chunks:
            q_starts.append(used)
            used += -(-len(chunk.token_ids) // align) * align
        t = self.prefill_bucket(used)
        pages = self.backend.prefill_pages(self, t, chunks)
        s = self.chunks_per_call

        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        query_pos = np.full(t, -1, np.int32)         # -1: padding, attends to nothing
        slot_mapping = np.zeros(t, np.int32)         # padding writes into the null block
        targets = np.full(t, -1, np.int32)
        sample_index = np.zeros(s, np.int32)
        token_slots = np.full(s, self.cfg.max_num_seqs, np.int32)
        rows: list[SamplingRow | None] = [None] * s
        tables = np.zeros((s, pages), np.int32)
        for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
            n, end = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
            table = pad_block_table(chunk.block_table, pages)
            span = slice(q0, q0 + n)
            tokens[span] = chunk.token_ids
            positions[span] = query_pos[span] = np.arange(chunk.start, end)
            slot_mapping[span] = table[positions[span] // bs] * bs + positions[span] % bs
            targets[q0:q0 + n - 1] = chunk.token_ids[1:]
            targets[q0 + n - 1] = next_tokens.get(chunk.seq_id, -1)
            sample_index[i] = q0 + n - 1
            tables[i] = table
            if chunk.sample:
                rows[i] = plan.sampling[chunk.seq_id]
                token_slots[i] = chunk.slot
        meta = self.backend.prefill_metadata(chunks, q_starts, tables, query_pos, t, pages)
        return ModelCall(ModelCallKey.prefill(t, pages), (tokens, positions, slot_mapping, meta, sample_index),
                         rows, chunks=list(chunks), q_starts=q_starts, targets=targets,
                         want_prompt_logprobs=any(c.prompt_logprobs is not None for c in chunks),
                         token_slots=token_slots)

    def pool_inputs(self, call: ModelCall) -> tuple[np.ndarray, np.ndarray]:
        """A prefill call's chunks for ("pool", tokens): each chunk's first row and length
        [chunks_per_call] int32 (length 0: no chunk)."""
        q_starts = np.zeros(self.chunks_per_call, np.int32)
        lengths = np.zeros(self.chunks_per_call, np.int32)
        for i, (chunk, q0) in enumerate(zip(call.chunks, call.q_starts)):
            q_starts[i], lengths[i] = q0, len(chunk.token_ids)
        return q_starts, lengths

    # ---- one call per step ----------------------------------------------------------------
    def model_calls(self, plan: StepPlan, next_tokens: dict[int, int]) -> list[ModelCall]:
        """The step's model calls: its packed prefill calls, then its decode call; with
        `unified`, a decode call of the largest row bucket rides in the first prefill call
        (`mixed_call`)."""
        calls = [self.prefill_call(group, plan, next_tokens)
                 for group in self.pack_prefills(plan.prefills)]
        if not plan.decodes:
            return calls
        decode = self.decode_call(plan)
        if self.unified and calls and decode.key.rows == self.decode_row_buckets()[-1]:
            return [self.mixed_call(decode, calls[0])] + calls[1:]
        return calls + [decode]

    @staticmethod
    def mixed_call(decode: ModelCall, prefill: ModelCall) -> ModelCall:
        """One call computing both: the decode call's inputs, then the prefill call's."""
        return ModelCall(ModelCallKey.mixed(decode.key, prefill.key), decode.args + prefill.args,
                         rows=[], parts=(decode, prefill))

    # ---- warm-up -------------------------------------------------------------------------
    def placeholder_call(self, kind: str, a: int, b: int, *more: int) -> ModelCall:
        """A call of the given bucket on inputs that touch nothing: every token writes into and
        reads from the null block, and every length is 0."""
        if kind == "mixed":
            return self.mixed_call(self.placeholder_call("decode", a, b),
                                   self.placeholder_call("prefill", *more))
        if kind == "decode":
            rows, size = a, b                          # size: work items (xla) or pages
            zeros, nowhere = np.zeros(rows, np.int32), np.full(rows, self.cfg.max_num_seqs, np.int32)
            meta = self.backend.placeholder_decode_metadata(rows, size)
            return ModelCall(ModelCallKey.decode(rows, size), (zeros, zeros - 1, zeros, zeros, meta),
                             [None] * rows, token_slots=nowhere)
        tokens, pages = a, b
        s, zeros = self.chunks_per_call, np.zeros(tokens, np.int32)
        meta = self.backend.placeholder_prefill_metadata(tokens, pages, s)
        return ModelCall(ModelCallKey.prefill(tokens, pages), (zeros, zeros, zeros, meta, np.zeros(s, np.int32)),
                         [None] * s, targets=np.full(tokens, -1, np.int32),
                         token_slots=np.full(s, self.cfg.max_num_seqs, np.int32))


def verify_inputs(decodes, num_rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For sampled drafts: the proposed token each decode row verifies and the q it was drawn
    from, (draft_token [rows] i32, -1 = verifies none; q [rows, V] f32), in `decode_call`'s row
    order: a sequence's row j verifies its proposal j, its last row (the bonus) none. None when
    no entry has q: the call then samples with the plain "sample" executable."""
    with_q = [d for d in decodes if d.draft_probs is not None]
    if not with_q:
        return None
    draft_token = np.full(num_rows, -1, np.int32)
    q = np.zeros((num_rows, with_q[0].draft_probs.shape[1]), np.float32)
    row = 0
    for d in decodes:
        n = len(d.draft_token_ids)
        if d.draft_probs is not None:
            draft_token[row:row + n] = d.draft_token_ids
            q[row:row + n] = d.draft_probs
        row += 1 + n
    return draft_token, q
