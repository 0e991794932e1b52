"""LLMEngine: add_request / step / abort_request, exactly as vLLM names them.

One `step()` reads as: schedule (host) -> dispatch (device) -> read and update (host). The
request's journey: `add_request` validates and queues its sequences in the scheduler's waiting
list; `step` admits them into slots, prefills them in chunks, decodes one token per step; stops
are applied in `Scheduler.update` (tokens) and `RequestState.apply_stop_strings` (text); a
finished request's blocks and slot are freed at once and its final output is returned then.
With host/device overlap (`async_scheduling`, the default) the step dispatched by one `step()`
is read by the next: between the two its sampled tokens are PENDING_TOKEN on the host and live
only on the device, and the next step is planned and dispatched before they are read.
"""
from __future__ import annotations

import dataclasses
import random
import time

import jax
import numpy as np

from jaxbatch.worker import compile_cache
from jaxbatch.core.config import SchedulerConfig, next_power_of_two
from jaxbatch.spec_decode.draft_model import DraftModelProposer
from jaxbatch.worker.kv_cache import blocks_for_budget, check_kv_cache_dtype
from jaxbatch.model.config import ModelConfig
from jaxbatch.model import llama, precision
from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.model.quantize import check_quantization, params_are_quantized, quantize_params
from jaxbatch.outputs import RequestOutput
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.engine.request_state import RequestState
from jaxbatch.worker.runner import ModelRunner
from jaxbatch.worker.sampler import MAX_BANNED
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.spec_decode.speculative import SpeculativeConfig

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_MAX_MODEL_LEN = 8192
CPU_KV_BUDGET_BYTES = 1 << 30
GPU_KV_MEMORY_FRACTION = 0.5


class LLMEngine:
    def __new__(cls, model: str | None = None, *, data_parallel_size: int = 1,
                num_processes: int = 1, **kwargs):
        """Replicas or several processes: the engine `jaxbatch.parallel.build_engine` makes
        (same interface); otherwise a plain LLMEngine."""
        if data_parallel_size != 1 or num_processes != 1:
            from jaxbatch.engine.build import build_engine
            return build_engine(model, data_parallel_size=data_parallel_size,
                                num_processes=num_processes, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: str | None = None, *, max_num_seqs: int = 32, block_size: int = 16,
                 num_blocks: int | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, dtype: str = "auto",
                 scheduling_policy: str = "fcfs", batching: str = "continuous", seed: int = 0,
                 prefill_chunk_size: int | None = None, attention_backend: str = "auto",
                 kv_cache_memory_bytes: int | None = None, warmup: bool = True,
                 compilation_cache: bool = True, kv_cache_dtype: str = "auto",
                 quantization: str | None = None, enable_prefix_caching: bool = True,
                 prefix_cache_granularity: str = "chunk",
                 speculative_config: dict | None = None, async_scheduling: bool = True,
                 tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, num_processes: int = 1, process_id: int = 0,
                 coordinator_address: str | None = None, devices=None,
                 loaded: LoadedModel | None = None, runner: ModelRunner | None = None):
        """`loaded` reuses weights already in memory; `runner` reuses another engine's compiled
        steps and KV pool (same model and shapes; the two engines must not run interleaved),
        which is how static and continuous batching are compared on identical executables.
        `enable_prefix_caching` shares the KV of prompt prefixes already computed (outputs
        are the same with it off; see jaxbatch/core/prefix_cache.py); `prefix_cache_granularity=
        "block"` shares prefixes in whole blocks as vLLM does, not whole prefill chunks (see
        SchedulerConfig). `speculative_config`
        ({"method": "ngram", "num_speculative_tokens": k, ...}, see jaxbatch/spec_decode/speculative.py)
        verifies proposed tokens in the decode step; the tokens are the same without it
        (with a draft model's "draft_sampling": "sampled", their distribution is).
        `async_scheduling` overlaps host and device: each step is planned while the previous
        one runs, its sampled tokens staying on device (outputs unchanged, one step later).
        `warmup` compiles every shape the scheduler can produce before the first request, so
        nothing compiles while serving; `compilation_cache` keeps the executables on disk.
        `tensor_parallel_size` splits the model over that many of `devices` (default: jax's
        devices, every process's; `jaxbatch/parallel/`). `data_parallel_size` or
        `num_processes` above 1 make `__new__` return the engine of `parallel/build.py`
        instead (LLMEngine's interface); here they are 1 and process_id and
        coordinator_address unused. `kv_cache_dtype="int8"` stores the KV cache as int8 with
        per-(token, KV head) scales; `quantization="int8"` makes the layer matrices int8
        (weight-only, per output channel)."""
        speculative = SpeculativeConfig.from_dict(speculative_config)   # fail before loading
        check_kv_cache_dtype(kv_cache_dtype)
        check_quantization(quantization)
        if compilation_cache:
            compile_cache.enable()
        # Split over devices: weights stay on the host until each device takes its slice.
        loaded = loaded or load_model(model, dtype, quantization=quantization,
                                      on_device=tensor_parallel_size == 1 and devices is None)
        if quantization == "int8" and not params_are_quantized(loaded.params):
            # Weights given in full precision (loaded=): quantize a copy, the caller's stay.
            loaded = dataclasses.replace(loaded, params=quantize_params(loaded.params))
        elif quantization is None and params_are_quantized(loaded.params):
            raise ValueError("loaded= holds int8 weights; pass quantization='int8'")
        # Stacked once here, so the per-layer copy is not kept alive beside the runner's.
        loaded.params = llama.stack_layers(loaded.params)
        self.loaded = loaded
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        mc = self.model_config
        param_dtype = loaded.params["embed"].dtype     # layer matrices may be int8
        self.kv_cache_dtype, self.quantization = kv_cache_dtype, quantization

        max_model_len = max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > mc.max_position_embeddings:
            window = (f" (capped at its sliding_window={mc.sliding_window}: attention here is "
                      f"full causal, exact only within the window)" if mc.sliding_window else "")
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}{window}")
        if max_num_batched_tokens is None:
            chunk = prefill_chunk_size or DEFAULT_PREFILL_CHUNK
            max_num_batched_tokens = max_num_seqs + chunk
        elif prefill_chunk_size is None:
            # The largest power of two that fits beside a full decode batch.
            room = max(1, max_num_batched_tokens - max_num_seqs)
            chunk = min(DEFAULT_PREFILL_CHUNK, 1 << (room.bit_length() - 1))
        else:
            chunk = prefill_chunk_size
        if num_blocks is None:
            num_blocks = self._default_num_blocks(mc, block_size, param_dtype, max_num_seqs,
                                                  max_model_len, kv_cache_memory_bytes,
                                                  kv_cache_dtype)
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs, block_size=block_size, num_blocks=num_blocks,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=chunk, scheduling_policy=scheduling_policy, batching=batching,
            enable_prefix_caching=bool(enable_prefix_caching),
            prefix_cache_granularity=prefix_cache_granularity)
        eos = tuple(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = tuple(sorted(set(eos) | {self.tokenizer.eos_token_id}))
        self.eos_token_ids = eos
        # What the KV depends on besides the tokens: cached blocks are keyed under it.
        namespace = (f"{loaded.source}|{param_dtype}|{mc}|block_size={block_size}"
                     f"|kv={kv_cache_dtype}|weights={quantization}")
        proposer = None
        if speculative is not None and speculative.method == "draft_model":
            proposer = DraftModelProposer(
                speculative.model, target_vocab_size=mc.vocab_size,
                max_num_seqs=speculative.max_batch_size, max_model_len=max_model_len,
                dtype=dtype, warmup=warmup, compilation_cache=compilation_cache,
                attention_backend=attention_backend, draft_sampling=speculative.draft_sampling)
        self.scheduler = Scheduler(self.config, eos, cache_namespace=namespace,
                                   speculative=speculative, proposer=proposer)
        if runner is None:
            tp = None
            if tensor_parallel_size != 1 or devices is not None:
                from jaxbatch.parallel.sharding import TensorParallel
                tp = TensorParallel(tensor_parallel_size, devices)
            runner = ModelRunner(mc, loaded.params, self.config, param_dtype, attention_backend,
                                 kv_cache_dtype, tensor_parallel=tp,
                                 lowered_dir=compile_cache.lowered_dir() if compilation_cache
                                 else None)
        elif (runner.cfg.max_num_seqs, runner.cfg.num_blocks, runner.cfg.block_size,
              runner.cfg.max_model_len, runner.cfg.prefill_chunk_size, runner.kv_cache_dtype,
              params_are_quantized(runner.params)) != (
                max_num_seqs, num_blocks, block_size, max_model_len, chunk, kv_cache_dtype,
                quantization == "int8"):
            raise ValueError("runner= needs the same max_num_seqs, num_blocks, block_size, "
                             "max_model_len, prefill chunk size, kv_cache_dtype and "
                             "quantization as this engine")
        self.runner = runner
        verify_keys_added = False
        if speculative is not None and speculative.draft_sampling == "sampled":
            # Decode calls that verify sampled drafts: at most max_batch_size sequences with
            # k proposals each (never more rows than max_num_seqs).
            verify_keys_added = runner.enable_verify_sampling(min(
                max_num_seqs, speculative.max_batch_size * (1 + speculative.num_speculative_tokens)))
        self._rng = random.Random(seed)
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._pending_outputs: list[RequestOutput] = []
        self.num_steps = 0
        # Host/device overlap: the step on the device while the host plans the next one.
        self.async_scheduling = bool(async_scheduling)
        self._in_flight = None
        self.device_wait_seconds = 0.0     # time the host spent waiting for step results
        self.num_overlapped_steps = 0      # steps planned while the previous one ran
        # Per step: (time, sequences computed, KV blocks in use, tokens computed).
        self.step_log: list[tuple[float, int, int, int]] = []
        self.warmup_seconds = 0.0
        if warmup and (not self.runner.warmed_up or verify_keys_added):
            self.warmup()

    @staticmethod
    def _default_num_blocks(mc, block_size, dtype, max_num_seqs, max_model_len, budget,
                            kv_cache_dtype="auto"):
        if budget is None:
            if jax.default_backend() == "cpu":
                budget = CPU_KV_BUDGET_BYTES
            else:
                stats = jax.devices()[0].memory_stats() or {}
                free = stats.get("bytes_limit", 16 << 30) - stats.get("bytes_in_use", 0)
                budget = int(free * GPU_KV_MEMORY_FRACTION)
        useful = max_num_seqs * -(-max_model_len // block_size) + 1
        return int(min(blocks_for_budget(mc, block_size, dtype, budget, kv_cache_dtype), useful))

    def warmup(self) -> float:
        self.warmup_seconds += self.runner.warmup()
        return self.warmup_seconds

    # ---- requests ------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as token ids")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt must be a string or a list of integer token ids")
        return None, [int(t) for t in ids]

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validates everything before touching any state, so a rejected request changes nothing."""
        text, ids, params = self.validate_request(request_id, prompt, params, priority)
        request_id = str(request_id)
        now = time.monotonic() if arrival_time is None else arrival_time
        self._create_sequences(request_id, text, ids, params, priority, now)

    def validate_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                         priority: int = 0) -> tuple[str | None, list[int], SamplingParams]:
        """Raises ValueError naming what is wrong; returns (prompt text, token ids, params).
        Changes nothing, so a caller can check a whole batch before adding any of it."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        params._validate()
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the "
                             f"vocabulary [0, {vocab})")
        max_len = self.config.max_model_len
        if len(ids) + 1 > max_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens cannot fit "
                             f"max_model_len={max_len} with one generated token")
        blocks = self.scheduler.blocks
        if blocks.blocks_for(len(ids) + 1) > blocks.num_total_blocks:
            raise ValueError(f"request {request_id!r}: prompt of {len(ids)} tokens needs more "
                             f"KV blocks than the whole pool ({blocks.num_total_blocks})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop_token_ids {bad_stop} are outside the vocabulary")
        if params.min_tokens and len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED} stop_token_ids + EOS ids")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} must be an integer")
        return text, ids, params

    def _create_sequences(self, request_id, text, ids, params, priority, now) -> None:
        seqs = []
        for i in range(params.n):
            if params.seed is None:
                seed = self._rng.getrandbits(32)
            else:
                seed = params.seed if i == 0 else hash((params.seed, i)) & 0xFFFFFFFF
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, seed, now, 0, priority)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None] * len(ids)
            self._next_seq_id += 1
            seqs.append(seq)
        self._requests[request_id] = RequestState(request_id, text, ids, params, now, seqs,
                                                   [""] * params.n)
        for seq in seqs:
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._requests.pop(rid, None)
            if state is None:
                continue  # unknown or already finished: nothing to do, as in vLLM
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._seqs.pop(seq.seq_id, None)
            self._pending_outputs.append(state.make_output())

    def cached_prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Prompt tokens this engine's prefix cache holds for such a request now."""
        if params.prompt_logprobs is not None:
            return 0
        return self.scheduler.cached_prefix_tokens(prompt_token_ids, params.cache_salt)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (blocks in use stay with their sequences)."""
        self.scheduler.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs. With `async_scheduling` (host/device overlap) the step planned
        here is dispatched and left running while the host reads and applies the previous
        step's tokens, so outputs come one step behind the device."""
        outputs, self._pending_outputs = self._pending_outputs, []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and self.scheduler.needs_tokens_to_plan(in_flight.plan, self._seqs):
            outputs += self._finish_step(in_flight)
            in_flight = None
        dispatched = None
        if self.scheduler.has_unfinished():
            if self.runner.pool_owner is not self:
                # Another engine sharing this runner wrote into the pool since this engine last
                # stepped: its cached prefixes may be gone.
                self.scheduler.reset_prefix_cache()
                self.runner.pool_owner = self
            plan = self.scheduler.schedule()
            if not plan.empty:
                dispatched = self._dispatch(plan)
                self.num_overlapped_steps += in_flight is not None
        if in_flight is not None:
            outputs += self._finish_step(in_flight)
        if dispatched is not None:
            self.scheduler.on_dispatched(dispatched.plan, self._seqs)
            if self.async_scheduling and self._has_live_sequence(dispatched.plan):
                self._in_flight = dispatched
            else:       # (a step only of sequences that ended meanwhile is not left pending)
                outputs += self._finish_step(dispatched)
        return outputs

    def _has_live_sequence(self, plan) -> bool:
        ids = [d.seq_id for d in plan.decodes] + [c.seq_id for c in plan.prefills]
        return any(i in self._seqs and not self._seqs[i].is_finished for i in ids)

    def _dispatch(self, plan):
        next_tokens = {c.seq_id: self._seqs[c.seq_id].token_at(c.start + len(c.token_ids))
                       for c in plan.prefills if c.prompt_logprobs is not None
                       and c.start + len(c.token_ids) < self._seqs[c.seq_id].num_tokens}
        dispatched = self.runner.dispatch(plan, next_tokens)
        self.num_steps += 1
        blocks = self.scheduler.blocks
        self.step_log.append((time.monotonic(), len(plan.decodes) + len(plan.prefills),
                              blocks.num_total_blocks - blocks.num_free_blocks, plan.num_tokens))
        return dispatched

    def _finish_step(self, dispatched) -> list[RequestOutput]:
        """Reads a dispatched step's tokens, applies them and the stops, and makes the outputs."""
        start = time.perf_counter()
        result = self.runner.collect(dispatched)
        self.device_wait_seconds += time.perf_counter() - start
        advanced = self.scheduler.update(dispatched.plan, result, self._seqs)
        outputs = []
        touched: dict[str, RequestState] = {}
        for seq in advanced:
            state = self._requests[seq.request_id]
            state.apply_stop_strings(seq, self.tokenizer, self.scheduler.finish)
            touched[seq.request_id] = state
        for rid, state in touched.items():
            outputs.append(state.make_output())
            if state.finished:
                del self._requests[rid]
                for seq in state.seqs:
                    self._seqs.pop(seq.seq_id, None)
        return outputs

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        blocks = self.scheduler.blocks
        spec, counters = self.scheduler.speculative, self.scheduler.spec_counters
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": blocks.num_free_blocks,
            "num_total_blocks": blocks.num_total_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compilations": self.runner.num_compilations,
            "num_compilations_after_warmup": len(self.runner.compilations_after_warmup),
            "num_steps": self.num_steps,
            "async_scheduling": self.async_scheduling,
            "device_wait_seconds": self.device_wait_seconds,
            "num_overlapped_steps": self.num_overlapped_steps,
            "compile_seconds": self.runner.compile_seconds,
            "attention_backend": self.runner.backend,
            "tensor_parallel_size": 1 if self.runner.tp is None else self.runner.tp.size,
            # What dtype="auto" chose (model/precision.py): the embedding's (matrices may be int8)
            "dtype": str(self.runner.params["embed"].dtype),
            # "int8", or the model dtype the "auto" cache stores (bf16 bits as uint16 on CPU)
            "kv_cache_dtype": precision.logical_kv_dtype(self.runner.pool[0].dtype),
            "quantization": self.quantization,
            "max_num_seqs": self.config.max_num_seqs,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "prefix_cache_granularity": self.config.prefix_cache_granularity,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "speculative_method": spec.method if spec else None,
            "spec_num_drafts": counters.num_drafts,
            "spec_num_draft_tokens": counters.num_draft_tokens,
            "spec_num_accepted_tokens": counters.num_accepted_tokens,
            "spec_accepted_per_position": list(counters.accepted_per_position),
            "spec_mean_accepted_length": counters.mean_accepted_length,
        }
