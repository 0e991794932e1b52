"""Device side: a small fixed set of compiled step functions over the slot array and the paged
KV pool, which is donated into every call and rebound to what comes back.

An engine step makes at most two kinds of call:
  decode   one token for each decoding sequence, rows padded to a power of two (at most
           next_power_of_two(max_num_seqs)).
           Attention inputs are padded to a bucket: the total pages in use (xla work items) or
           the longest block table (pallas, reference).
  prefill  the step's prefill chunks packed into one call (more only when they overflow the
           largest token bucket or MAX_CHUNKS_PER_CALL), tokens and pages padded to buckets.
Buckets are powers of two, so the set of executables is small and known; each is compiled
once (counted in `num_compilations`) and `warmup` compiles all of them up front.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch import attention, kv_cache, sampler
from jaxbatch.config import SchedulerConfig, next_power_of_two
from jaxbatch.model import llama
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.rope import inverse_frequencies
from jaxbatch.plan import (PrefillChunk, SampledToken, SamplingRow, StepPlan, StepResult,
                           pad_block_table)
from pallas_kernels.xla_paged_attention import (PAGES_PER_ITEM, PREFILL_TILE, decode_work_items,
                                                num_decode_items)

MIN_PREFILL_BUCKET = 16
MAX_PREFILL_BUCKET = 1024   # unless one chunk is larger
MAX_CHUNKS_PER_CALL = 8     # rows sampled per prefill call: the lm_head runs on this many
assert MIN_PREFILL_BUCKET % PREFILL_TILE == 0, "every prefill bucket must split into whole tiles"


def _decode_step(params, pool, tokens, positions, slot_mapping, attn_meta, samp, *, cfg, backend,
                 inv_freq, use_penalties, with_top_logprobs):
    attend = attention.decode_attend(backend, attn_meta, cfg.head_dim ** -0.5)
    hidden, pool = llama.forward_hidden(params, cfg, pool, tokens, positions, slot_mapping,
                                        attend, inv_freq)                       # [B, d]
    logits = llama.compute_logits(params, hidden)                               # [B, V]
    return sampler.sample(logits, samp, use_penalties, with_top_logprobs), pool


def _prefill_step(params, pool, tokens, positions, slot_mapping, attn_meta, sample_index,
                  targets, samp, *, cfg, backend, inv_freq, use_penalties, with_top_logprobs,
                  with_prompt_logprobs):
    attend = attention.prefill_attend(backend, attn_meta, cfg.head_dim ** -0.5)
    hidden, pool = llama.forward_hidden(params, cfg, pool, tokens, positions, slot_mapping,
                                        attend, inv_freq)                       # [T, d]
    last = hidden[sample_index]                                                 # [S, d]
    sampled = sampler.sample(llama.compute_logits(params, last), samp, use_penalties,
                             with_top_logprobs)
    prompt_lp = None
    if with_prompt_logprobs:
        prompt_lp = sampler.prompt_logprobs(llama.compute_logits(params, hidden), targets)
    return sampled, prompt_lp, pool


@dataclasses.dataclass
class _Call:
    """One compiled call: its step inputs (host arrays; params and pool are added at dispatch)
    and, for prefill, where each chunk sits in the packed rows."""
    key: tuple
    args: tuple
    fn: object
    chunks: list[PrefillChunk] = dataclasses.field(default_factory=list)
    q_starts: list[int] = dataclasses.field(default_factory=list)   # row of each chunk in the call


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, sched_cfg: SchedulerConfig, dtype,
                 attention_backend: str = "auto"):
        self.model_cfg = model_cfg
        self.cfg = sched_cfg
        self.params = params
        self.backend = attention.resolve_backend(attention_backend)
        self.work_lists = attention.uses_work_lists(self.backend)
        # The oracle's ragged attention costs tokens x sequences x context: one chunk per call.
        self.chunks_per_call = 1 if self.backend == "reference" else MAX_CHUNKS_PER_CALL
        # A top-k over the vocabulary is a visible part of a CPU decode step, so on CPU it is
        # compiled in only for steps where a request asks for logprobs (the first such step
        # compiles). On a GPU it is cheap, and compiling mid-serving is not: always in.
        self.top_logprobs_always = self.backend == "pallas"
        self.pool = kv_cache.allocate_pool(model_cfg, sched_cfg.num_blocks, sched_cfg.block_size, dtype)
        self._inv_freq = jnp.asarray(inverse_frequencies(model_cfg))
        self._executables: dict[tuple, object] = {}
        self.compile_seconds = 0.0

    # ---- buckets -------------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return len(self._executables)

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

    def decode_item_bucket(self, num_items: int) -> int:
        return min(next_power_of_two(num_items), self.max_decode_items)

    @property
    def max_prefill_tokens(self) -> int:
        """Largest packed prefill call: what the token budget allows, kept to a size whose
        attention scores fit comfortably, but never below one whole chunk."""
        budget_pow2 = 1 << (self.cfg.max_num_batched_tokens.bit_length() - 1)
        return max(MIN_PREFILL_BUCKET, self.cfg.prefill_chunk_size,
                   min(budget_pow2, MAX_PREFILL_BUCKET))

    def prefill_bucket(self, num_tokens: int) -> int:
        return min(max(MIN_PREFILL_BUCKET, next_power_of_two(num_tokens)), self.max_prefill_tokens)

    def prefill_page_bucket(self, tokens_bucket: int, num_pages: int) -> int:
        """At least the pages the call's tokens would span: a few more keys for calls packing
        short prompts, and half as many (tokens, pages) executables to compile."""
        return self.page_bucket(max(num_pages, tokens_bucket // self.cfg.block_size))

    def _compiled(self, key: tuple, fn, args):
        exe = self._executables.get(key)
        if exe is None:
            start = time.perf_counter()
            exe = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[key] = exe
        return exe

    # ---- decode --------------------------------------------------------------------------
    def decode_row_bucket(self, num_decodes: int) -> int:
        return min(next_power_of_two(num_decodes), next_power_of_two(self.cfg.max_num_seqs))

    def _decode_call(self, plan: StepPlan) -> _Call:
        """Decoding sequences take rows 0..n-1 in plan order, padded to a power of two: on a
        CPU a matmul costs in proportion to its rows, so a half-empty slot array should not
        pay for the empty half. Padding rows write into the null block."""
        bs = self.cfg.block_size
        b = self.decode_row_bucket(len(plan.decodes))
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        slot_mapping = np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)             # 0 = padding row
        rows: list[SamplingRow | None] = [None] * b
        for i, d in enumerate(plan.decodes):
            tokens[i] = d.token_id
            positions[i] = d.position
            slot_mapping[i] = d.block_table[d.position // bs] * bs + d.position % bs
            lengths[i] = d.position + 1
            rows[i] = plan.sampling[d.seq_id]
        if self.work_lists:
            items = self.decode_item_bucket(num_decode_items(lengths, bs))
            meta = decode_work_items([(i, d.block_table, d.position + 1)
                                      for i, d in enumerate(plan.decodes)], b, bs, items) + (lengths,)
        else:
            pages = self.page_bucket(max(len(d.block_table) for d in plan.decodes))
            tables = np.zeros((b, pages), np.int32)
            for i, d in enumerate(plan.decodes):
                tables[i] = pad_block_table(d.block_table, pages)
            meta = (tables, lengths)
        return self._finish_decode_call((tokens, positions, slot_mapping, meta), rows)

    def _finish_decode_call(self, inputs, rows) -> _Call:
        use_penalties = any(r is not None and r.history for r in rows)
        with_top = self.top_logprobs_always or any(r is not None and r.logprobs for r in rows)
        samp = sampler.build_sampling_arrays(rows, self.cfg.max_model_len if use_penalties else 1)
        args = inputs + (samp,)
        key = ("decode", len(rows), inputs[3][0].shape, use_penalties, with_top)
        fn = functools.partial(_decode_step, cfg=self.model_cfg, backend=self.backend,
                               inv_freq=self._inv_freq, use_penalties=use_penalties,
                               with_top_logprobs=with_top)
        return _Call(key, args, fn)

    # ---- prefill -------------------------------------------------------------------------
    def _pack_prefills(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        """Greedy, in plan order: chunks join a call while its padded tokens fit."""
        align = PREFILL_TILE if self.work_lists else 1
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

    def _prefill_call(self, chunks: list[PrefillChunk], plan: StepPlan,
                      next_tokens: dict[int, int]) -> _Call:
        bs = self.cfg.block_size
        align = PREFILL_TILE if self.work_lists else 1
        q_starts, used = [], 0
        for chunk in chunks:
            q_starts.append(used)
            used += -(-len(chunk.token_ids) // align) * align
        t = self.prefill_bucket(used)
        max_pages = max(-(-(c.start + len(c.token_ids)) // bs) for c in chunks)
        pages = self.prefill_page_bucket(t, max_pages)
        s = self.chunks_per_call

        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        query_pos = np.full(t, -1, np.int32)         # -1: padding, attends to nothing
        slot_mapping = np.zeros(t, np.int32)         # padding writes into the null block
        targets = np.full(t, -1, np.int32)           # token after each position (prompt logprobs)
        sample_index = np.zeros(s, np.int32)
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
        if self.work_lists:
            # Every tile of a chunk carries its sequence's block table.
            tile_pages = np.zeros((t // PREFILL_TILE, pages), np.int32)     # [T / tile, P]
            for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
                last = q0 + len(chunk.token_ids) - 1
                tile_pages[q0 // PREFILL_TILE:last // PREFILL_TILE + 1] = tables[i]
            meta = (query_pos, tile_pages)
        else:
            # The ragged contract: chunks packed back to back (align = 1 here).
            kv_lens = np.zeros(s, np.int32)
            cu_q_lens = np.zeros(s + 1, np.int32)
            for i, (chunk, q0) in enumerate(zip(chunks, q_starts)):
                kv_lens[i] = chunk.start + len(chunk.token_ids)
                cu_q_lens[i + 1:] = q0 + len(chunk.token_ids)
            meta = (kv_lens, tables, cu_q_lens, np.array([len(chunks)], np.int32))

        use_penalties = any(r is not None and r.history for r in rows)
        with_top = self.top_logprobs_always or any(r is not None and r.logprobs for r in rows)
        with_lp = any(c.prompt_logprobs is not None for c in chunks)
        samp = sampler.build_sampling_arrays(rows, self.cfg.max_model_len if use_penalties else 1)
        args = (tokens, positions, slot_mapping, meta, sample_index, targets, samp)
        key = ("prefill", t, pages, use_penalties, with_top, with_lp)
        fn = functools.partial(_prefill_step, cfg=self.model_cfg, backend=self.backend,
                               inv_freq=self._inv_freq, use_penalties=use_penalties,
                               with_top_logprobs=with_top, with_prompt_logprobs=with_lp)
        return _Call(key, args, fn, chunks=chunks, q_starts=q_starts)

    # ---- one engine step -----------------------------------------------------------------
    def _dispatch(self, call: _Call):
        args = (self.params, self.pool) + call.args
        out = self._compiled(call.key, call.fn, args)(*args)
        self.pool = out[-1]
        return out[:-1]

    def execute(self, plan: StepPlan, next_tokens: dict[int, int]) -> StepResult:
        """`next_tokens[seq_id]`: the token after a prefill chunk (for prompt logprobs), -1 if none."""
        start = time.perf_counter()
        calls = [self._prefill_call(group, plan, next_tokens)
                 for group in self._pack_prefills(plan.prefills)]
        if plan.decodes:
            calls.append(self._decode_call(plan))
        # Dispatch every call before reading anything back.
        pending = [(call, self._dispatch(call)) for call in calls]
        result = StepResult(sampled={}, prompt_logprobs={})
        for call, out in pending:
            if call.key[0] == "decode":
                tokens, logprob, top_ids, top_lp = (np.asarray(x) for x in out[0])
                for i, d in enumerate(plan.decodes):
                    result.sampled[d.seq_id] = _sampled(i, tokens, logprob, top_ids, top_lp,
                                                        plan.sampling[d.seq_id].logprobs)
                continue
            (sampled, prompt_lp) = out
            tokens, logprob, top_ids, top_lp = (np.asarray(x) for x in sampled)
            for i, (chunk, q0) in enumerate(zip(call.chunks, call.q_starts)):
                if chunk.sample:
                    result.sampled[chunk.seq_id] = _sampled(i, tokens, logprob, top_ids, top_lp,
                                                            plan.sampling[chunk.seq_id].logprobs)
                if chunk.prompt_logprobs is not None:
                    result.prompt_logprobs[chunk.seq_id] = _prompt_logprobs(
                        chunk, q0, next_tokens.get(chunk.seq_id, -1), prompt_lp)
        result.timings["execute_s"] = time.perf_counter() - start
        return result

    # ---- warm-up -------------------------------------------------------------------------
    def bucket_shapes(self):
        """Every call shape the scheduler can produce with these settings, for the default
        sampling (penalties, prompt logprobs and, on CPU, logprobs compile on first use):
        ("decode", rows, work items (xla) or pages) and ("prefill", tokens, pages)."""
        max_pages = self.max_page_bucket
        page_buckets = [1 << i for i in range(max_pages.bit_length())]
        shapes = []
        rows = 1
        while rows <= self.decode_row_bucket(self.cfg.max_num_seqs):
            if self.work_lists:
                # n rows in (rows/2, rows] need between n and n * max_items_per_seq items.
                most = self.decode_item_bucket(rows * self.max_items_per_seq)
                size = self.decode_item_bucket(rows)
                while size <= most:
                    shapes.append(("decode", rows, size))
                    size *= 2
            else:
                shapes += [("decode", rows, p) for p in page_buckets]
            rows *= 2
        t = MIN_PREFILL_BUCKET
        while t <= self.max_prefill_tokens:
            for p in page_buckets:
                if p == self.prefill_page_bucket(t, p):
                    shapes.append(("prefill", t, p))
            t *= 2
        return shapes

    def warmup(self) -> float:
        """Compiles every bucket on inputs that touch nothing: every token writes into and
        reads from the null block, and every length is 0."""
        start = time.perf_counter()
        for kind, a, b in self.bucket_shapes():
            if kind == "decode":
                rows, size = a, b                      # size: work items (xla) or pages
                zeros = np.zeros(rows, np.int32)
                if self.work_lists:
                    meta = (np.full(size, rows, np.int32),              # every item is padding
                            np.zeros((size, PAGES_PER_ITEM), np.int32), np.zeros(size, np.int32),
                            zeros)
                else:
                    meta = (np.zeros((rows, size), np.int32), zeros)
                self._dispatch(self._finish_decode_call((zeros, zeros, zeros, meta), [None] * rows))
                continue
            tokens, pages = a, b
            s, zeros = self.chunks_per_call, np.zeros(tokens, np.int32)
            if self.work_lists:
                meta = (np.full(tokens, -1, np.int32),
                        np.zeros((tokens // PREFILL_TILE, pages), np.int32))
            else:
                meta = (np.zeros(s, np.int32), np.zeros((s, pages), np.int32),
                        np.zeros(s + 1, np.int32), np.zeros(1, np.int32))
            with_top = self.top_logprobs_always
            fn = functools.partial(_prefill_step, cfg=self.model_cfg, backend=self.backend,
                                   inv_freq=self._inv_freq, use_penalties=False,
                                   with_top_logprobs=with_top, with_prompt_logprobs=False)
            args = (zeros, zeros, zeros, meta, np.zeros(s, np.int32), zeros,
                    sampler.build_sampling_arrays([None] * s, 1))
            self._dispatch(_Call(("prefill", tokens, pages, False, with_top, False), args, fn))
        jax.block_until_ready(self.pool)
        return time.perf_counter() - start


def _sampled(row, tokens, logprob, top_ids, top_lp, k) -> SampledToken:
    top = None
    if k:
        top = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lp[row, :k])}
    return SampledToken(int(tokens[row]), float(logprob[row]), top)


def _prompt_logprobs(chunk: PrefillChunk, q0: int, next_token: int, out) -> list[tuple[int, dict[int, float]]]:
    """Logits at packed row q0 + i (chunk position i) score the token at absolute position
    start + i + 1."""
    target, top_ids, top_lp = (np.asarray(x) for x in out)
    k = chunk.prompt_logprobs
    following = list(chunk.token_ids[1:]) + [next_token]
    entries = []
    for i, token in enumerate(following):
        if token < 0:
            continue
        row = q0 + i
        d = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lp[row, :k])}
        d[int(token)] = float(target[row])
        entries.append((chunk.start + i + 1, d))
    return entries
