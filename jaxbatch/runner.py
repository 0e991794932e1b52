"""Device side: a small fixed set of compiled step functions over the slot array and the paged
KV pool, which is donated into every call and rebound to what comes back.

Two kinds of call make up an engine step:
  decode   [max_num_seqs] slots, one token each; block tables padded to a page bucket.
  prefill  one chunk of one sequence, its token count and page count padded to buckets.
Buckets are powers of two, so the set of executables is small and known; each is compiled
once (counted in `num_compilations`) and `warmup` compiles all of them up front.
"""
from __future__ import annotations

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
from jaxbatch.block_manager import NULL_BLOCK
from jaxbatch.plan import (DecodeEntry, PrefillChunk, SampledToken, SamplingRow, StepPlan,
                           StepResult, pad_block_table)

MIN_PREFILL_BUCKET = 16


def _decode_step(params, pool, tokens, positions, slot_mapping, block_tables, lengths, samp, *,
                 cfg, backend, inv_freq, use_penalties):
    attend = attention.decode_attend(backend, block_tables, lengths, cfg.head_dim ** -0.5)
    hidden, pool = llama.forward_hidden(params, cfg, pool, tokens, positions, slot_mapping,
                                        attend, inv_freq)                       # [B, d]
    logits = llama.compute_logits(params, hidden)                               # [B, V]
    return sampler.sample(logits, samp, use_penalties), pool


def _prefill_step(params, pool, tokens, positions, slot_mapping, page_indices, kv_lens, cu_q_lens,
                  last_index, next_tokens, samp, *, cfg, backend, inv_freq, use_penalties,
                  with_prompt_logprobs):
    attend = attention.ragged_attend(backend, kv_lens, page_indices, cu_q_lens, 1,
                                     cfg.head_dim ** -0.5)
    hidden, pool = llama.forward_hidden(params, cfg, pool, tokens, positions, slot_mapping,
                                        attend, inv_freq)                       # [C, d]
    last = jax.lax.dynamic_slice_in_dim(hidden, last_index, 1)                  # [1, d]
    sampled = sampler.sample(llama.compute_logits(params, last), samp, use_penalties)
    prompt_lp = None
    if with_prompt_logprobs:
        prompt_lp = sampler.prompt_logprobs(llama.compute_logits(params, hidden), next_tokens)
    return sampled, prompt_lp, pool


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, sched_cfg: SchedulerConfig, dtype,
                 attention_backend: str = "auto"):
        self.model_cfg = model_cfg
        self.cfg = sched_cfg
        self.params = params
        self.backend = attention.resolve_backend(attention_backend)
        self.pool = kv_cache.allocate_pool(model_cfg, sched_cfg.num_blocks, sched_cfg.block_size, dtype)
        self._inv_freq = jnp.asarray(inverse_frequencies(model_cfg))
        self._executables: dict[tuple, object] = {}
        self.compile_seconds = 0.0

    # ---- buckets -------------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return len(self._executables)

    def page_bucket(self, num_pages: int) -> int:
        return min(next_power_of_two(max(1, num_pages)), next_power_of_two(self.cfg.max_pages_per_seq))

    def prefill_bucket(self, num_tokens: int) -> int:
        return min(max(MIN_PREFILL_BUCKET, next_power_of_two(num_tokens)), self.cfg.prefill_chunk_size)

    def _compiled(self, key: tuple, fn, args):
        exe = self._executables.get(key)
        if exe is None:
            start = time.perf_counter()
            exe = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[key] = exe
        return exe

    # ---- decode --------------------------------------------------------------------------
    def _decode_inputs(self, plan: StepPlan):
        b, bs = self.cfg.max_num_seqs, self.cfg.block_size
        pages = self.page_bucket(max(len(d.block_table) for d in plan.decodes))
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        slot_mapping = np.zeros(b, np.int32)        # empty slots write into the null block
        block_tables = np.zeros((b, pages), np.int32)
        lengths = np.zeros(b, np.int32)             # 0 = empty slot
        rows = [None] * b
        for d in plan.decodes:
            tokens[d.slot] = d.token_id
            positions[d.slot] = d.position
            slot_mapping[d.slot] = d.block_table[d.position // bs] * bs + d.position % bs
            block_tables[d.slot] = pad_block_table(d.block_table, pages)
            lengths[d.slot] = d.position + 1
            rows[d.slot] = plan.sampling[d.seq_id]
        return (tokens, positions, slot_mapping, block_tables, lengths), rows

    def _run_decode(self, plan: StepPlan):
        inputs, rows = self._decode_inputs(plan)
        use_penalties = any(r is not None and r.history for r in rows)
        samp = sampler.build_sampling_arrays(rows, self.cfg.max_model_len if use_penalties else 1)
        args = (self.params, self.pool) + inputs + (samp,)
        key = ("decode", inputs[3].shape[1], use_penalties)
        fn = functools.partial(_decode_step, cfg=self.model_cfg, backend=self.backend,
                               inv_freq=self._inv_freq, use_penalties=use_penalties)
        out, self.pool = self._compiled(key, fn, args)(*args)
        return out, rows

    # ---- prefill -------------------------------------------------------------------------
    def _prefill_inputs(self, chunk: PrefillChunk, next_token: int):
        bs = self.cfg.block_size
        n = len(chunk.token_ids)
        c = self.prefill_bucket(n)
        end = chunk.start + n
        pages = self.page_bucket(max(-(-end // bs), c // bs))
        tokens = np.zeros(c, np.int32)
        tokens[:n] = chunk.token_ids
        positions = np.zeros(c, np.int32)
        positions[:n] = np.arange(chunk.start, end)
        table = np.asarray(chunk.block_table, np.int32)
        slot_mapping = np.zeros(c, np.int32)
        slot_mapping[:n] = table[positions[:n] // bs] * bs + positions[:n] % bs
        page_indices = pad_block_table(chunk.block_table, pages)[None, :]       # [1, P]
        kv_lens = np.array([end], np.int32)
        cu_q_lens = np.array([0, n], np.int32)
        next_tokens = np.full(c, -1, np.int32)
        next_tokens[:n - 1] = chunk.token_ids[1:]
        next_tokens[n - 1] = next_token
        return (tokens, positions, slot_mapping, page_indices, kv_lens, cu_q_lens,
                np.int32(n - 1), next_tokens)

    def _run_prefill(self, chunk: PrefillChunk, plan: StepPlan, next_token: int):
        inputs = self._prefill_inputs(chunk, next_token)
        row = plan.sampling.get(chunk.seq_id)
        use_penalties = bool(row is not None and row.history)
        samp = sampler.build_sampling_arrays([row], self.cfg.max_model_len if use_penalties else 1)
        with_lp = chunk.prompt_logprobs is not None
        args = (self.params, self.pool) + inputs + (samp,)
        key = ("prefill", inputs[0].shape[0], inputs[3].shape[1], use_penalties, with_lp)
        fn = functools.partial(_prefill_step, cfg=self.model_cfg, backend=self.backend,
                               inv_freq=self._inv_freq, use_penalties=use_penalties,
                               with_prompt_logprobs=with_lp)
        sampled, prompt_lp, self.pool = self._compiled(key, fn, args)(*args)
        return sampled, prompt_lp

    # ---- one engine step -----------------------------------------------------------------
    def execute(self, plan: StepPlan, next_tokens: dict[int, int]) -> StepResult:
        """`next_tokens[seq_id]`: the token after a prefill chunk (for prompt logprobs), -1 if none."""
        start = time.perf_counter()
        pending = []   # dispatch every call before reading anything back
        for chunk in plan.prefills:
            next_token = next_tokens.get(chunk.seq_id, -1)
            sampled, prompt_lp = self._run_prefill(chunk, plan, next_token)
            pending.append(("prefill", chunk, sampled, (prompt_lp, next_token)))
        if plan.decodes:
            out, rows = self._run_decode(plan)
            pending.append(("decode", plan.decodes, out, rows))
        result = StepResult(sampled={}, prompt_logprobs={})
        for kind, what, out, extra in pending:
            tokens, logprob, top_ids, top_lp = (np.asarray(x) for x in out)
            if kind == "prefill":
                if what.sample:
                    result.sampled[what.seq_id] = _sampled(0, tokens, logprob, top_ids, top_lp,
                                                           plan.sampling[what.seq_id].logprobs)
                prompt_lp, next_token = extra
                if prompt_lp is not None:
                    result.prompt_logprobs[what.seq_id] = _prompt_logprobs(what, next_token, prompt_lp)
            else:
                for d in what:
                    result.sampled[d.seq_id] = _sampled(d.slot, tokens, logprob, top_ids, top_lp,
                                                        plan.sampling[d.seq_id].logprobs)
        result.timings["execute_s"] = time.perf_counter() - start
        return result

    # ---- warm-up -------------------------------------------------------------------------
    def bucket_shapes(self):
        """Every (kind, tokens, pages) the scheduler can produce with these settings."""
        max_pages = self.page_bucket(self.cfg.max_pages_per_seq)
        page_buckets = [1 << i for i in range(max_pages.bit_length()) if 1 << i <= max_pages]
        shapes = [("decode", self.cfg.max_num_seqs, p) for p in page_buckets]
        c = MIN_PREFILL_BUCKET
        while True:
            c = min(c, self.cfg.prefill_chunk_size)
            for p in page_buckets:
                if p >= min(c // self.cfg.block_size, max_pages) and c <= self.cfg.max_model_len:
                    shapes.append(("prefill", c, p))
            if c >= self.cfg.prefill_chunk_size:
                break
            c *= 2
        return shapes

    def warmup(self) -> float:
        """Compiles every bucket (penalties and prompt logprobs compile on first use). The
        warm-up plans point every block table at the null block, so the pool is untouched."""
        start = time.perf_counter()
        bs = self.cfg.block_size
        row = SamplingRow(-1, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, 0, 1, [], [], None)
        for kind, tokens, pages in self.bucket_shapes():
            null_table = [NULL_BLOCK] * pages
            if kind == "decode":
                plan = StepPlan(0, [], [DecodeEntry(-1, 0, 0, (pages - 1) * bs, null_table)], {-1: row})
            else:
                start_pos = max(0, pages * bs - tokens)
                plan = StepPlan(0, [PrefillChunk(-1, [0] * tokens, start_pos, null_table, True, None)],
                                [], {-1: row})
            self.execute(plan, {})
        jax.block_until_ready(self.pool)
        return time.perf_counter() - start


def _sampled(row, tokens, logprob, top_ids, top_lp, k) -> SampledToken:
    top = None
    if k:
        top = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lp[row, :k])}
    return SampledToken(int(tokens[row]), float(logprob[row]), top)


def _prompt_logprobs(chunk: PrefillChunk, next_token: int, out) -> list[tuple[int, dict[int, float]]]:
    """Logits at chunk position i score the token at absolute position start + i + 1."""
    target, top_ids, top_lp = (np.asarray(x) for x in out)
    k = chunk.prompt_logprobs
    following = list(chunk.token_ids[1:]) + [next_token]
    entries = []
    for i, token in enumerate(following):
        if token < 0:
            continue
        d = {int(t): float(lp) for t, lp in zip(top_ids[i, :k], top_lp[i, :k])}
        d[int(token)] = float(target[i])
        entries.append((chunk.start + i + 1, d))
    return entries
