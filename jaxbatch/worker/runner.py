"""Device side: a small fixed set of compiled functions over the slot array and the paged KV
pool, which is donated into every model call and rebound to what comes back.

Each engine step dispatches, without reading anything back in between:
  model calls       ("decode", rows, items|pages) and ("prefill", tokens, pages), laid out by
                    `step_inputs.StepLayout`: forward pass -> logits of the sampled rows (on
                    the xla backend items and pages are fixed per rows or tokens: its
                    attention loops over the context in use at run time); with unified
                    steps a step's decode rows and prefill tokens in one ("mixed", rows,
                    items, tokens, pages) call, whose two parts are then sampled apart
  sampling          ("sample", rows): one executable per row count, shared by every model call
                    of that many rows (kept out of the model calls: it is half their compile time)
  prompt logprobs   ("prompt_logprobs", tokens): only for prefill calls that ask
  pooling           ("pool", tokens): a pooling engine's prefill calls run it in place of
                    sampling (`pooling.py`: one vector per chunk); such an engine compiles
                    only prefill calls and these
  verification      ("verify_sample", rows): decode calls carrying sampled drafts' q, in place
                    of "sample"; only with draft_sampling="sampled" (`enable_verify_sampling`)
Keys are records (`executable_keys.py`: `ModelCallKey`, `SampleKey`; written above in their
tuple form). Every key is compiled once (`num_compilations`); `warmup` compiles all of them
up front (`compilation.py`, which the runner feeds with its functions, keys and example
arguments); a compilation after warm-up is logged and counted as a bug
(`compilations_after_warmup`).
"""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.worker import attention, kernels as kernel_seam, kv_cache, lowered_store, pooling
from jaxbatch.worker import sampler
from jaxbatch.worker import weight_forms
from jaxbatch.worker.compilation import Executables
from jaxbatch.worker.inputs import DECODE_ARGS, DecodeInputs, PrefillInputs
from jaxbatch.worker.model_calls import (decode_forward, mixed_forward, prefill_forward,
                                         prompt_logprobs_step)
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.model import precision
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.layers import unsharded
from jaxbatch.model.rope import inverse_frequencies
from jaxbatch.core.plan import SamplingRow, StepPlan, StepResult
from jaxbatch.worker.dispatched import DispatchedStep, ForwardedPart, ForwardedStep
from jaxbatch.worker.read_back import prompt_logprobs_entries, sampled_token
from jaxbatch.worker.executable_keys import ModelCallKey, SampleKey, as_key
from jaxbatch.worker.step_inputs import ModelCall, StepLayout

logger = logging.getLogger(__name__)


def _sample_and_keep(sample_fn, logits, sampling_arrays, kept_tokens, token_slots, *extra):
    """`sample_fn` (a jaxbatch.worker.sampler function; `extra` its further inputs), and each row's
    token kept under its slot ([S]; slot S = not kept) for the next step's decode call to
    read on device."""
    out = sample_fn(logits, sampling_arrays, *extra)
    return out + (kept_tokens.at[token_slots].set(out[0], mode="drop"),)


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, sched_cfg: SchedulerConfig, dtype,
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                 tensor_parallel=None, lowered_dir: str | None = None, unified_step: bool = True,
                 kernel_options: kernel_seam.KernelOptions = kernel_seam.KernelOptions()):
        """`tensor_parallel`: a `jaxbatch.parallel.sharding.TensorParallel` that places the
        params and pool on its mesh and gives every compiled call its shardings; None on one
        device (the default path, untouched by any of it). `lowered_dir`: where the lowered
        step functions are kept between starts (`lowered_store.py`; None: nowhere). Only
        plain-jnp attention on one device uses it (Pallas kernels are custom calls that
        `jax.export` refuses, and sharded calls carry shardings). `unified_step`: a step's
        decode rows and prefill tokens share one model call where the backend allows it
        (`step_inputs.StepLayout`). `kernel_options`: the engine's kernel options
        (`worker/kernels.py`, which chooses every kernel once, here)."""
        self.tp = tensor_parallel
        self.cfg = sched_cfg
        self.backend = attention.resolve_backend(attention_backend)
        self.kv_cache_dtype = kv_cache_dtype
        # The storage dtype: bf16 bits as uint16 on CPU (model/precision.py).
        pool_dtype = precision.kv_pool_dtype(dtype, self.backend)
        kv_dtype = (jnp.int8 if kv_cache_dtype == "int8" else
                    pool_dtype if tensor_parallel is None else jnp.dtype(dtype))
        # Every kernel of this engine, chosen once (the KV heads per device are the model's
        # divided evenly, so the group and head_dim the kernels see are the model's).
        self.kernels = kernel_seam.choose(model_cfg=model_cfg, dtype=dtype, pool_dtype=kv_dtype,
                                          options=kernel_options,
                                          tensor_parallel=tensor_parallel is not None,
                                          block_size=sched_cfg.block_size)
        kernel_seam.log_choice(self.kernels)
        params = weight_forms.prepare(stack_layers(params), self.kernels.weight_form)
        if self.tp is not None:
            # The runner's config may have more KV heads (copies) than the checkpoint's.
            model_cfg, params = self.tp.prepare(model_cfg, params)
        self.model_cfg = model_cfg
        self.params = params
        # (k, v), plus their scales for an int8 cache: one pytree, donated whole.
        if self.tp is None:
            self.pool = kv_cache.allocate_pool(model_cfg, sched_cfg.num_blocks, sched_cfg.block_size,
                                               pool_dtype, kv_cache_dtype)
        else:
            self.pool = self.tp.allocate_pool(model_cfg, sched_cfg.num_blocks,
                                              sched_cfg.block_size, dtype)
        # The backend, laying calls out for the kernels it was handed.
        self.attention = attention.get_backend(self.backend).with_kernels(self.kernels)
        chunks_per_call = self.attention.chunks_per_call
        self.layout = StepLayout(sched_cfg, self.attention, unified_step)
        self._inv_freq = jnp.asarray(inverse_frequencies(model_cfg))
        common = dict(cfg=model_cfg, backend=self.attention, kernels=self.kernels.kernels,
                      inv_freq=self._inv_freq,
                      per_shard=unsharded if self.tp is None else self.tp.per_shard)
        sample = functools.partial(sampler.sample, argmax=self.kernels.argmax)
        verify = functools.partial(sampler.sample_verified, argmax=self.kernels.argmax)
        functions = {  # kind -> (function, index of the donated pool argument or None,
            #                           number of outputs: the pool, when donated, is the last)
            "decode": (functools.partial(decode_forward, **common), 1, 2),
            "prefill": (functools.partial(prefill_forward, **common), 1, 3),
            "mixed": (functools.partial(mixed_forward, **common), 1, 4),
            "sample": (functools.partial(_sample_and_keep, sample), None, None),
            "verify_sample": (functools.partial(_sample_and_keep, verify), None, None),
            "prompt_logprobs": (functools.partial(prompt_logprobs_step, cfg=model_cfg), None, None),
        }
        # Each slot's last sampled token, on device: threaded through every sample call.
        self.kept_tokens = jnp.zeros(sched_cfg.max_num_seqs, jnp.int32)
        store = None
        if lowered_dir is not None and self.tp is None and self.attention.exportable:
            store = lowered_store.LoweredStore(lowered_dir, lowered_store.fingerprint(
                model_cfg, sched_cfg, jnp.dtype(dtype).name, repr(self.attention),
                kv_cache_dtype, chunks_per_call, self.kernels.reasons))
        self.executables = Executables(functions, store, self.tp)
        self.verify_rows = 0       # ("verify_sample", rows) executables for rows up to this
        self.pooling_type: str | None = None    # a pooling engine's: see enable_pooling
        # A sampled draft model's runner: (seq_id, position) -> the q that position drew from.
        self.kept_probs: dict[tuple[int, int], np.ndarray] | None = None
        self._unused_history: dict[int, jax.Array] = {}
        self._unused_bitmask: dict[int, jax.Array] = {}     # structured outputs: all allowed
        self._unused_bias: dict[int, tuple[jax.Array, jax.Array]] = {}   # no logit_bias
        self.pool_owner = None     # the engine whose block manager last wrote the pool
        self.executable_observers: list = []   # benchmarks' hook, see _run

    # What the compiled set reports, for stats().
    num_compilations = property(lambda self: len(self.executables))
    compile_seconds = property(lambda self: self.executables.compile_seconds)
    warmed_up = property(lambda self: self.executables.warmed_up)
    warmup_report = property(lambda self: self.executables.warmup_report)
    compilations_after_warmup = property(lambda self: self.executables.compilations_after_warmup)

    def bucket_shapes(self) -> list[ModelCallKey | SampleKey]:
        """Every key the scheduler can make this runner execute."""
        if self.pooling_type is not None:
            # A pooling engine's calls are prefill calls, pooled and never sampled.
            return ([k for k in self.layout.bucket_shapes() if k.kind == "prefill"]
                    + [SampleKey("pool", t) for t in self.layout.prefill_token_buckets()])
        return self.layout.executable_keys() + [SampleKey("verify_sample", n) for n in
                                                self.layout.decode_row_buckets() if n <= self.verify_rows]

    def enable_pooling(self, pooling_type: str) -> bool:
        """A pooling engine (embeddings): every prefill call runs ("pool", tokens) instead of
        sampling, which reduces the call's hidden states to one vector per chunk
        (`pooling.py`); its keys are the prefill calls' and these, compiled at warm-up (it
        never decodes or samples). True if this added keys."""
        if self.pooling_type == pooling_type:
            return False
        if self.pooling_type is not None or len(self.executables):
            raise ValueError("runner= is shared only by engines of one kind: this one already "
                             f"{'pools' if self.pooling_type else 'generates'}")
        self.pooling_type = pooling_type
        self.executables.functions["pool"] = (functools.partial(
            pooling.pool_step, pooling.POOLERS[pooling_type],
            window=self.cfg.prefill_chunk_size), None, None)
        return True

    def enable_verify_sampling(self, max_rows: int) -> bool:
        """Speculation with sampled drafts: decode calls of up to `max_rows` rows may carry q
        and sample with ("verify_sample", rows), compiled at warm-up like every key (separate
        executables, so engines without sampled drafts compile and run exactly what they did).
        True if this added keys."""
        bucket = self.layout.decode_row_bucket(max_rows)
        added = bucket > self.verify_rows
        self.verify_rows = max(self.verify_rows, bucket)
        return added

    def keep_sampling_probs(self) -> None:
        """For a draft model sampling its proposals: every "sample" executable also returns the
        distributions, and `execute` keeps those of rows with temperature > 0 in `kept_probs`.
        It replaces the sample function, so it must come before anything is compiled."""
        if len(self.executables):
            raise RuntimeError("keep_sampling_probs() after compiling: the sample executables "
                               "would not return the probabilities")
        sample = functools.partial(sampler.sample_with_probs, argmax=self.kernels.argmax)
        self.executables.functions["sample"] = (functools.partial(_sample_and_keep, sample),
                                                None, None)
        self.kept_probs = {}

    # ---- executables ---------------------------------------------------------------------
    def _run(self, key: ModelCallKey | SampleKey, args):
        """Every executable the runner runs goes through here."""
        if not self.executable_observers:
            return self.executables.run(key, args)
        # Benchmarks' hook (benchmarks/observer.py): with an observer attached each
        # executable is waited for, so its wall time is its device time (profiling only).
        start = time.perf_counter()
        out = jax.block_until_ready(self.executables.run(key, args))
        for observer in self.executable_observers:
            observer.on_executable(key, time.perf_counter() - start)
        return out

    def sampling_arrays(self, rows: list[SamplingRow | None], bitmask: np.ndarray | None = None):
        """Penalty history always has max_model_len columns (one executable for every request);
        steps without penalties pass a -1 array kept on device per row count. The same for
        the grammar bitmask (structured outputs): `bitmask` [n, ceil(V/32)] or None, and the
        logit_bias arrays."""
        n = len(rows)
        if n not in self._unused_history:
            self._unused_history[n] = jnp.full((n, self.cfg.max_model_len), -1, jnp.int32)
            self._unused_bitmask[n] = jnp.full(
                (n, sampler.bitmask_words(self.model_cfg.vocab_size)), -1, jnp.int32)
            self._unused_bias[n] = (jnp.full((n, sampler.MAX_LOGIT_BIAS), -1, jnp.int32),
                                    jnp.zeros((n, sampler.MAX_LOGIT_BIAS), jnp.float32))
        return sampler.build_sampling_arrays(rows, self.cfg.max_model_len, self._unused_history[n],
                                             bitmask, self._unused_bitmask[n],
                                             unused_bias=self._unused_bias[n])

    def example_args(self, key):
        """Arguments of the right shapes for `key` (a key record, or its tuple form), for
        lowering at warm-up."""
        key = as_key(key)
        kind = key.kind
        if isinstance(key, ModelCallKey):
            return self.model_args(key, self.layout.placeholder_call(kind, *key.sizes).args)
        vocab, n = self.model_cfg.vocab_size, key.rows
        if kind == "sample":
            return (jax.ShapeDtypeStruct((n, vocab), jnp.float32), self.sampling_arrays([None] * n),
                    self.kept_tokens, np.zeros(n, np.int32))
        if kind == "verify_sample":
            return (jax.ShapeDtypeStruct((n, vocab), jnp.float32), self.sampling_arrays([None] * n),
                    self.kept_tokens, np.zeros(n, np.int32),
                    jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n, vocab), jnp.float32))
        # The embedding's dtype is the activations' (layer matrices may be int8).
        hidden = jax.ShapeDtypeStruct((n, self.model_cfg.hidden_size), self.params["embed"].dtype)
        if kind == "pool":
            chunks = np.zeros(self.layout.chunks_per_call, np.int32)
            return hidden, chunks, chunks
        return (self.params, hidden, jax.ShapeDtypeStruct((n,), jnp.int32))

    def model_args(self, key: ModelCallKey, call_args: tuple,
                    call: ModelCall | None = None) -> tuple:
        # `call` (None at warm-up): for subclasses adding per-row inputs (jaxbatch/lora/runner.py).
        kind = as_key(key).kind
        if kind == "decode":
            inputs = DecodeInputs.of(self.kept_tokens, call_args)
        elif kind == "mixed":
            inputs = (DecodeInputs.of(self.kept_tokens, call_args[:DECODE_ARGS]),
                      PrefillInputs.of(call_args[DECODE_ARGS:]))
        else:
            inputs = PrefillInputs.of(call_args)
        return self.params, self.pool, inputs

    # ---- one engine step -----------------------------------------------------------------
    # The engine drives a step in two calls, so nothing here calls back up into it:
    # `dispatch_model_calls` (forwards on the device), then, once the engine has filled the
    # grammar masks while they run, `dispatch_sampling(forwarded, masks)`.
    def dispatch_model_calls(self, plan: StepPlan, next_tokens: dict[int, int]) -> ForwardedStep:
        """Lays out and dispatches every model call of the step; returns at once (JAX runs them
        asynchronously). `next_tokens[seq_id]`: the token after a prefill chunk (for prompt
        logprobs), -1 if none."""
        started = time.perf_counter()
        self.apply_adapter_loads(plan)
        parts = [part for call in self.layout.model_calls(plan, next_tokens)
                 for part in self._dispatch(call)]
        return ForwardedStep(plan, next_tokens, parts, started)

    def apply_adapter_loads(self, plan: StepPlan) -> None:
        """What the plan asks of the device before its model calls: nothing in a plain runner
        (a LoRA runner writes the adapters the plan loads, jaxbatch/lora/runner.py)."""
        if plan.adapter_loads:
            raise ValueError("a plan loading LoRA adapters needs a LoRA engine's runner")

    def _dispatch(self, call: ModelCall) -> list[ForwardedPart]:
        """A model call: device arrays, nothing read. -> one part per sampled part of the call
        (a mixed call's decode and prefill parts are sampled apart)."""
        out = self._run(call.key, self.model_args(call.key, call.args, call))
        self.pool = out[-1]
        if call.parts is not None:          # (decode logits, prefill logits, prefill hidden)
            decode, prefill = call.parts
            return [ForwardedPart(decode, out[0], None), ForwardedPart(prefill, out[1], out[2])]
        return [ForwardedPart(call, out[0], out[1] if call.key.kind == "prefill" else None)]

    def dispatch_sampling(self, step: ForwardedStep, masks: list | None = None) -> DispatchedStep:
        """Samples every part of a forwarded step (and its prompt logprobs). `masks`: per part
        (`step.sampling_rows()`'s order) its grammar bitmask [rows, ceil(V/32)] int32 or None
        (structured outputs); None: no part has one."""
        masks = masks or [None] * len(step.parts)
        pending = [(part.call, self._sample(part.call, part.logits, part.hidden, mask))
                   for part, mask in zip(step.parts, masks, strict=True)]
        return DispatchedStep(step.plan, step.next_tokens, pending,
                              time.perf_counter() - step.started)

    def _sample(self, call: ModelCall, logits, hidden, bitmask):
        if self.pooling_type is not None:
            return None, None, self._pool(call, hidden)
        arrays = self.sampling_arrays(call.rows, bitmask)
        kind, verify = ("sample", ()) if call.verify is None else ("verify_sample", call.verify)
        *sampled, self.kept_tokens = self._run(
            SampleKey(kind, len(call.rows)),
            (logits, arrays, self.kept_tokens, call.token_slots) + verify)
        prompt_lp = None
        if call.want_prompt_logprobs:
            prompt_lp = self._run(SampleKey("prompt_logprobs", call.key.tokens),
                                  (self.params, hidden, call.targets))
        if self.tp is not None:
            sampled, prompt_lp = self.tp.to_host((sampled, prompt_lp))
        return sampled, prompt_lp, None

    def _pool(self, call: ModelCall, hidden):
        """A pooling engine's prefill call: one vector per chunk (`pooling.py`)."""
        return self._run(SampleKey("pool", call.key.tokens),
                         (hidden, *self.layout.pool_inputs(call)))

    def execute(self, plan: StepPlan, next_tokens: dict[int, int]) -> StepResult:
        """`next_tokens[seq_id]`: the token after a prefill chunk (for prompt logprobs), -1 if none."""
        return self.collect(self.dispatch(plan, next_tokens))

    def dispatch(self, plan: StepPlan, next_tokens: dict[int, int]) -> DispatchedStep:
        """A whole step with no grammar masks (model calls, then their sampling); returns at
        once, so the host can plan the next step meanwhile."""
        return self.dispatch_sampling(self.dispatch_model_calls(plan, next_tokens))

    def collect(self, step: "DispatchedStep") -> StepResult:
        """Waits for a dispatched step and reads its tokens (and logprobs) back."""
        start = time.perf_counter()
        plan, next_tokens = step.plan, step.next_tokens
        result = StepResult(sampled={}, prompt_logprobs={})
        for call, (sampled, prompt_lp, pooled) in step.pending:
            if pooled is not None:
                vectors = np.asarray(pooled)
                result.pooled.update((chunk.seq_id, vectors[i])
                                     for i, chunk in enumerate(call.chunks) if chunk.pool)
                continue
            tokens, logprob = np.asarray(sampled[0]), np.asarray(sampled[1])
            if self.kept_probs is not None:
                self._keep_probs(call.rows, sampled[4])
            # The [rows, 20] top-k arrays cross to the host only when some row reads them.
            top_ids = top_lp = None
            if any(r is not None and r.logprobs for r in call.rows):
                top_ids, top_lp = np.asarray(sampled[2]), np.asarray(sampled[3])
            if call.key.kind == "decode":
                for i, (seq_id, j) in enumerate(call.decode_rows):
                    token = sampled_token(i, tokens, logprob, top_ids, top_lp,
                                     plan.sampling[seq_id].logprobs)
                    if j == 0:
                        result.sampled[seq_id] = token
                    else:
                        result.draft_sampled.setdefault(seq_id, []).append(token)
                continue
            for i, (chunk, q0) in enumerate(zip(call.chunks, call.q_starts)):
                if chunk.sample:
                    result.sampled[chunk.seq_id] = sampled_token(
                        i, tokens, logprob, top_ids, top_lp, plan.sampling[chunk.seq_id].logprobs)
                if chunk.prompt_logprobs is not None:
                    result.prompt_logprobs[chunk.seq_id] = prompt_logprobs_entries(
                        chunk, q0, next_tokens.get(chunk.seq_id, -1), prompt_lp)
        result.timings["dispatch_s"] = step.dispatch_seconds
        result.timings["collect_s"] = time.perf_counter() - start
        return result

    def _keep_probs(self, rows: list[SamplingRow | None], probs) -> None:
        """The whole [rows, V] distribution crosses to the host, once per call, only in a
        sampled draft's engine and only when some row samples: cheap on a CPU (host memory);
        on an accelerator a device-to-host copy per draft step, the price of sampled drafts."""
        wanted = [(i, r) for i, r in enumerate(rows) if r is not None and r.temperature > 0]
        if wanted:
            probs = np.asarray(probs)
            for i, r in wanted:
                self.kept_probs[(r.seq_id, r.position)] = probs[i]

    # ---- warm-up -------------------------------------------------------------------------
    def warmup(self, max_workers: int | None = None, *, run: bool) -> float:
        """Compiles every key the scheduler can produce (`compilation.Executables.warmup`);
        `run`: also runs each model call once (`run_placeholder`; the engine passes its
        `warmup_runs` option)."""
        return self.executables.warmup(self.bucket_shapes(), self.example_args, max_workers,
                                       self.run_placeholder if run else None)

    def is_model_call(self, key) -> bool:
        return isinstance(as_key(key), ModelCallKey)

    def run_placeholder(self, key: ModelCallKey | SampleKey) -> None:
        """Runs a model call's executable once on `StepLayout.placeholder_call`'s inputs, which
        write only into the null blocks and attend to nothing, and waits for it. The sampling
        and prompt-logprob executables are not run: at most one library dot each (the LM
        head's), their first run costs little."""
        if not self.is_model_call(key):
            return
        out = self.executables.run(key, self.example_args(key))
        self.pool = out[-1]
        jax.block_until_ready(out)
