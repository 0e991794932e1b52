"""LLMEngine: add_request / step / abort_request, exactly as vLLM names them.

A request's path through one engine: `add_request` validates it and makes its sequences (one
per completion), which wait in the scheduler (`core/scheduler.py`); the output processor
(`output_processor.py`) holds its text state. Each `step()` is schedule -> execute -> update:
the scheduler plans which tokens of which sequences run (admitting waiting ones into free
slots, chunking prefills, asking its KV blocks of the block manager); the runner
(`worker/runner.py`) executes the plan on the device; `Scheduler.update` appends the sampled
tokens and applies token stops; the output processor decodes text, finds stop strings (the
scheduler finishes those sequences) and builds the `RequestOutput`s. A finished request's
blocks and slot are freed at once. With host/device overlap (`async_scheduling`) the step
dispatched by one `step()` is read by the next: between the two its sampled tokens are
PENDING_TOKEN on the host and live only on the device.

Building an engine (weights, sizes, runner, speculation) is `setup.py`'s; the options are
`config.py`'s; data-parallel replicas and multi-process engines come from `build.py`.
"""
from __future__ import annotations

import dataclasses
import random
import time

import numpy as np


from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.engine import pooling, setup
from jaxbatch.engine.interface import EngineBase
from jaxbatch.engine.output_processor import OutputProcessor, RequestState
from jaxbatch.lora.request import lora_cache_salt
from jaxbatch.model import precision
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel
from jaxbatch.outputs import RequestOutput
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.spec_decode.speculative import NO_SPECULATION_STATS, SpeculativeConfig
from jaxbatch.structured.manager import StructuredOutputManager
from jaxbatch.worker import compile_cache, weight_forms
from jaxbatch.worker.runner import ModelRunner
from jaxbatch.worker.sampler import MAX_BANNED


class LLMEngine(EngineBase):
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None,
                 runner: ModelRunner | None = None, devices=None, **options):
        """`options`: the engine options of `engine/config.py` (LLM's keyword arguments).
        `loaded` reuses weights already in memory; `runner` reuses another engine's compiled
        steps and KV pool (same model and shapes; the two engines must not run interleaved),
        which is how static and continuous batching are compared on identical executables;
        `devices`: the devices tensor parallelism splits over (default: jax's, every
        process's). Replicas (`data_parallel_size`) and several processes (`num_processes`)
        are other engines: `jaxbatch.engine.build.build_engine` (or `LLM`) makes them."""
        # Every combination checked, runner= and devices= too, before anything loads.
        config, runner = setup.engine_config(model, runner, devices, options)
        par = config.parallel
        if par.data_parallel_size != 1 or par.num_processes != 1:
            raise ValueError("data_parallel_size / num_processes above 1 make another kind of "
                             "engine: build it with jaxbatch.build_engine(...) or LLM(...)")
        self.options = config
        speculative = SpeculativeConfig.from_dict(config.speculative.speculative_config)
        if config.runtime.compilation_cache:
            compile_cache.enable()
        loaded = setup.load_weights(config, loaded, devices)
        self.loaded = loaded
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.reasoning = setup.reasoning_parser(config, self.tokenizer)
        self.load_seconds = loaded.load_seconds
        param_dtype = loaded.params["embed"].dtype     # layer matrices may be int8
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.quantization = config.model.quantization
        self.config = setup.scheduler_config(config, self.model_config, param_dtype)
        eos = tuple(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = tuple(sorted(set(eos) | {self.tokenizer.eos_token_id}))
        self.eos_token_ids = eos
        planner = setup.speculative_planner(speculative, config, self.config,
                                            self.model_config.vocab_size, LLMEngine)
        self.scheduler = Scheduler(self.config, eos, speculation=planner,
                                   cache_namespace=setup.cache_namespace(loaded, config,
                                                                         param_dtype))
        if runner is None:
            runner = setup.make_runner(config, loaded, self.config, devices)
        else:
            setup.check_shared_runner(runner, self.config, config)
        self.runner = runner
        # LoRA adapters (jaxbatch/lora/): the manager, or None without enable_lora.
        self.lora = setup.lora_manager(config, runner, self.scheduler)
        # KV events (jaxbatch/kv_events/): the prefix cache's observer (a no-op one if off)
        self.kv_events = setup.kv_events(config, self.config, self.scheduler, self.lora)
        # Structured outputs: the grammar matchers' one seam into the step (jaxbatch/structured/).
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  eos, self.config.max_model_len,
                                                  reasoning=self.reasoning)
        self.pooler, keys_added = pooling.make_pooler(config, loaded, runner)  # or None
        if speculative is not None and speculative.draft_sampling == "sampled":
            # Decode calls that verify sampled drafts: at most max_batch_size sequences with
            # k proposals each (never more rows than max_num_seqs).
            keys_added = runner.enable_verify_sampling(min(
                self.config.max_num_seqs,
                speculative.max_batch_size * (1 + speculative.num_speculative_tokens)))
        self._rng = random.Random(config.runtime.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.reasoning)
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._pending_outputs: list[RequestOutput] = []
        self.num_steps = 0
        # Host/device overlap: the step on the device while the host plans the next one.
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight = None
        self.device_wait_seconds = 0.0     # time the host spent waiting for step results
        self.num_overlapped_steps = 0      # steps planned while the previous one ran
        # Per step: (time, sequences computed, KV blocks in use, tokens computed).
        self.step_log: list[tuple[float, int, int, int]] = []
        # --- benchmarks hook (benchmarks/observer.py): called once per step read back
        self.step_observers: list = []
        self.warmup_seconds = 0.0
        if config.runtime.warmup and (not self.runner.warmed_up or keys_added):
            self.warmup()

    def warmup(self) -> float:
        self.warmup_seconds += self.runner.warmup(run=self.options.runtime.warmup_runs)
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
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request=None) -> None:
        """Validates everything before touching any state, so a rejected request changes nothing.
        `lora_request`: a jaxbatch.LoRARequest (needs enable_lora=True) or None."""
        text, ids, params = self.validate_request(request_id, prompt, params, priority)
        lora = None if lora_request is None else (lora_request, self._lora_weights(lora_request))
        if lora is not None:   # its KV is the adapter's: cached under the adapter's salt
            params = dataclasses.replace(params, cache_salt=lora_cache_salt(params.cache_salt,
                                                                            lora_request))
        request_id = str(request_id)
        now = time.monotonic() if arrival_time is None else arrival_time
        self._create_sequences(request_id, text, ids, params, priority, now, lora)

    def validate_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                         priority: int = 0, lora_request=None
                         ) -> tuple[str | None, list[int], SamplingParams]:
        """Raises ValueError naming what is wrong; returns (prompt text, token ids, params).
        Changes nothing, so a caller can check a whole batch before adding any of it."""
        self._lora_weights(lora_request)
        params = pooling.checked_params(self.pooler, params)     # SamplingParams or PoolingParams
        request_id = str(request_id)
        if request_id in self.outputs:
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
        if isinstance(params, pooling.PoolingParams):
            return text, ids, params
        params.check_token_ids(vocab)
        if params.min_tokens and len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED} stop_token_ids + EOS ids")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} must be an integer")
        self.structured.check(params, len(ids))   # structured outputs: compiles, and fits
        return text, ids, params

    def _lora_weights(self, lora_request):
        """The adapter's host weights (ValueError if bad, or if this is no LoRA engine)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        return self.lora.check(lora_request)

    # ---- LoRA adapters (EngineClient's adapter calls) -------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Reads and checks the adapter (ValueError if bad) into the host cache, so requests
        naming it need not read it again (the server's load, before any request uses it)."""
        if self.lora is None:
            return super().add_lora(lora_request)
        self.lora.check(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Forgets an adapter no unfinished request uses; False if unknown."""
        if self.lora is None:
            return super().remove_lora(lora_name)
        return self.lora.remove(lora_name)

    def list_loras(self) -> set[int]:
        """The ids of the adapters requests have used and those read into the host cache."""
        return set() if self.lora is None else set(self.lora.known) | set(self.lora.host)

    def _create_sequences(self, request_id, text, ids, params, priority, now, lora=None) -> None:
        if isinstance(params, pooling.PoolingParams):     # an embedding: one prefill-only sequence
            state = pooling.EmbeddingState.of(self._next_seq_id, request_id, ids, params,
                                              self.pooler, priority, now)
            self._next_seq_id += 1
            return self._add_sequences(state)
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
            if lora is not None:
                self.lora.add(seq, *lora)
            seqs.append(seq)
        self._add_sequences(RequestState(request_id, text, ids, params, now, seqs, [""] * params.n))

    def _add_sequences(self, state) -> None:
        self.outputs.add(state)
        for seq in state.seqs:
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
            self.structured.add(seq)           # structured outputs: its matcher

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self.outputs.abort(rid)
            if state is None:
                continue  # unknown or already finished: nothing to do, as in vLLM
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._seqs.pop(seq.seq_id, None)
                self.structured.remove(seq.seq_id)
            self._pending_outputs.append(state.make_output())

    def cached_prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Prompt tokens this engine's prefix cache holds for such a request now."""
        if isinstance(params, pooling.PoolingParams) or params.prompt_logprobs is not None:
            return 0
        return self.scheduler.cached_prefix_tokens(prompt_token_ids, params.cache_salt)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (blocks in use stay with their sequences)."""
        self.scheduler.reset_prefix_cache()
        self.kv_events.flush()
        return True

    def shutdown(self) -> None:
        """Publishes the last KV events and closes their sockets."""
        self.kv_events.close()

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    def has_pending_outputs(self) -> bool:
        """Final outputs of aborted requests, handed out by the next step()."""
        return bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs)

    def prepare_for_serving(self) -> None:
        """Builds the grammar tokenizer on a background thread (structured outputs)."""
        self.structured.prepare_in_background()

    def sequence_ids(self, request_id: str) -> list[int]:
        """The ids of an unfinished request's sequences (one per completion)."""
        return [seq.seq_id for seq in self.outputs.requests[request_id].seqs]

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
                if self.lora is not None:      # LoRA: the adapter loads and slots ride the plan
                    self.lora.plan_adapters(plan)
                self.num_overlapped_steps += in_flight is not None
                dispatched, read_early = self._dispatch(plan, in_flight)
                if read_early is not None:
                    outputs += read_early
                    in_flight = None
        if in_flight is not None:
            outputs += self._finish_step(in_flight)
        if dispatched is not None:
            self.scheduler.on_dispatched(dispatched.plan, self._seqs)
            if self.async_scheduling and self._has_live_sequence(dispatched.plan):
                self._in_flight = dispatched
            else:       # (a step only of sequences that ended meanwhile is not left pending)
                outputs += self._finish_step(dispatched)
        self.kv_events.flush()      # what the prefix cache did this step, as one batch
        return outputs

    def _has_live_sequence(self, plan) -> bool:
        ids = [d.seq_id for d in plan.decodes] + [c.seq_id for c in plan.prefills]
        return any(i in self._seqs and not self._seqs[i].is_finished for i in ids)

    def _dispatch(self, plan, in_flight):
        """The step's one pass through the rooms: dispatch its forwards; then, only if some
        row samples under a grammar, read the previous step (`in_flight`: its tokens advance
        the matchers) and fill the masks while the forwards run; then dispatch sampling with
        the masks as data. Steps without grammar rows never wait (as vLLM overlaps it).
        -> (the dispatched step, the outputs of `in_flight` if it was read here, else None)."""
        next_tokens = {c.seq_id: self._seqs[c.seq_id].token_at(c.start + len(c.token_ids))
                       for c in plan.prefills if c.prompt_logprobs is not None
                       and c.start + len(c.token_ids) < self._seqs[c.seq_id].num_tokens}
        forwarded = self.runner.dispatch_model_calls(plan, next_tokens)
        read_early, masks = None, None
        if self.structured.num_sequences:
            rows = forwarded.sampling_rows()
            if in_flight is not None and self._has_grammar_row(rows):
                read_early = self._finish_step(in_flight)
                self.structured.num_overlapped_fills += 1
            drafts = {d.seq_id: d.draft_token_ids for d in plan.decodes if d.draft_token_ids}
            masks = [self.structured.fill_bitmask(part_rows, drafts) for part_rows in rows]
        dispatched = self.runner.dispatch_sampling(forwarded, masks)
        self.num_steps += 1
        blocks = self.scheduler.blocks
        self.step_log.append((time.monotonic(), len(plan.decodes) + len(plan.prefills),
                              blocks.num_total_blocks - blocks.num_free_blocks, plan.num_tokens))
        return dispatched, read_early

    def _has_grammar_row(self, rows) -> bool:
        return any(r is not None and self.structured.has(r.seq_id) for part in rows for r in part)

    def _finish_step(self, dispatched) -> list[RequestOutput]:
        """Reads a dispatched step's tokens, applies them and the stops, and makes the outputs."""
        start = time.perf_counter()
        result = self.runner.collect(dispatched)
        wait = time.perf_counter() - start
        self.device_wait_seconds += wait
        # --- benchmarks hook: observers watch steps here instead of patching the engine
        for observer in self.step_observers:
            observer.on_step(dispatched.plan, result.timings.get("dispatch_s", 0.0), wait)
        advanced = self.scheduler.update(dispatched.plan, result, self._seqs)
        for seq in advanced:
            self.structured.advance(seq)       # structured outputs: the matcher takes the token
        for seq, stop in self.outputs.stop_strings(advanced):
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, stop)
        outputs, done = self.outputs.outputs(advanced)
        for seq in done:
            self._seqs.pop(seq.seq_id, None)
            self.structured.remove(seq.seq_id)
        return outputs

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        speculation = self.scheduler.speculation
        # Requests, not sequences (n=8 is one request), for vllm:num_requests_*.
        running = {s.request_id for s in self.scheduler.running}
        attention_case = (self.runner.pool[0].dtype, self.runner.model_cfg)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_running_requests": len(running),
            "num_waiting_requests": len({s.request_id for s in self.scheduler.waiting} - running),
            **self.scheduler.kv_cache.stats(),   # the pool and the prefix cache
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
            # On CPU: our kernels (cpu_kernels/) where they cover the pool, else jnp and why
            "decode_attention": self.runner.attention.decode_kernel_name(*attention_case),
            "prefill_attention": self.runner.attention.prefill_kernel_name(*attention_case),
            "matmuls": weight_forms.matmuls(self.runner.params),   # our CPU GEMM kernel, or XLA's
            # What runs each heavy operation, and why (worker/kernels.py, chosen once)
            "kernels": self.runner.kernels.describe(),
            # "int8", or the model dtype the "auto" cache stores (bf16 bits as uint16 on CPU)
            "kv_cache_dtype": precision.logical_kv_dtype(self.runner.pool[0].dtype),
            "quantization": self.quantization,
            "max_num_seqs": self.config.max_num_seqs,
            **(speculation.stats() if speculation is not None else NO_SPECULATION_STATS),
            **self.structured.stats(),        # structured outputs: structured_* counters
            **(self.lora.stats() if self.lora is not None else {}),   # LoRA: lora_* counters
        }
