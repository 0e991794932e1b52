"""What building one engine takes, in the order it happens: weights, sizes, the speculative
planner, the runner. `LLMEngine.__init__` calls these; each is a plain function of the options
(`engine/config.py`) and what the previous ones made, so a reader sees every decision here
and nowhere else."""
from __future__ import annotations

import dataclasses
import logging

import jax

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.engine.config import EngineConfig
from jaxbatch.kv_events.config import NO_KV_EVENTS, KVEventsConfig
from jaxbatch.lora.request import user_cache_salt
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.model.quantize import int8_weights, params_are_quantized, quantize_params
from jaxbatch.reasoning.parser import ReasoningParser, get_reasoning_parser
from jaxbatch.spec_decode.draft_model import DraftModelProposer
from jaxbatch.spec_decode.planner import SpeculativePlanner
from jaxbatch.spec_decode.speculative import SpeculativeConfig
from jaxbatch.worker import compile_cache
from jaxbatch.worker.kv_cache import blocks_for_budget
from jaxbatch.worker.kernels import KernelOptions
from jaxbatch.worker.runner import ModelRunner
from jaxbatch.worker.weight_forms import to_plain

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_MAX_MODEL_LEN = 8192
CPU_KV_BUDGET_BYTES = 1 << 30
GPU_KV_MEMORY_FRACTION = 0.5


def engine_config(model, runner, devices, options: dict) -> tuple[EngineConfig, ModelRunner | None]:
    """LLMEngine's options checked (every combination, and what its `runner=` and `devices=`
    add) -> (config, the runner to share or None). `runner=` names two things: a string is
    the `runner` option ("generate" | "pooling", vLLM's spelling), a ModelRunner another
    engine's compiled steps and pool."""
    if isinstance(runner, str):
        options, runner = {**options, "runner": runner}, None
    config = EngineConfig.from_kwargs(model=model, **options)
    config.check_engine_args(runner=runner, devices=devices)
    return config, runner


def load_weights(config: EngineConfig, loaded: LoadedModel | None,
                 devices=None) -> LoadedModel:
    """The checkpoint's weights (or `loaded`'s), quantized as asked and stacked per layer."""
    m = config.model
    # Split over devices: weights stay on the host until each device takes its slice.
    on_device = config.parallel.tensor_parallel_size == 1 and devices is None
    if loaded is None:
        loaded = dataclasses.replace(load_model(m.model, m.dtype, quantization=m.quantization,
                                                on_device=on_device), private=True)
    if int8_weights(m.quantization) and not params_are_quantized(loaded.params):
        # Weights given in full precision (loaded=): quantize a copy, the caller's stay.
        loaded = dataclasses.replace(loaded, params=quantize_params(to_plain(loaded.params)))
    elif m.quantization is None and params_are_quantized(loaded.params):
        raise ValueError("loaded= holds int8 weights; pass quantization='int8' or 'w8a8'")
    # Stacked once here, so the per-layer copy is not kept alive beside the runner's.
    loaded.params = stack_layers(loaded.params)
    return loaded


def scheduler_config(config: EngineConfig, mc: ModelConfig, param_dtype) -> SchedulerConfig:
    """The options resolved against the model and the device: max_model_len, the prefill
    chunk and budget, the pool's size."""
    s, c = config.scheduler, config.cache
    max_model_len = s.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={mc.max_position_embeddings}")
    budget, chunk = s.max_num_batched_tokens, s.prefill_chunk_size
    if budget is None:
        chunk = chunk or DEFAULT_PREFILL_CHUNK
        budget = s.max_num_seqs + chunk
    elif chunk is None:
        # The largest power of two that fits beside a full decode batch.
        room = max(1, budget - s.max_num_seqs)
        chunk = min(DEFAULT_PREFILL_CHUNK, 1 << (room.bit_length() - 1))
    num_blocks = c.num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(mc, c.block_size, param_dtype, s.max_num_seqs,
                                        max_model_len, c.kv_cache_memory_bytes,
                                        c.kv_cache_dtype)
    return SchedulerConfig(
        max_num_seqs=s.max_num_seqs, block_size=c.block_size, num_blocks=num_blocks,
        max_model_len=max_model_len, max_num_batched_tokens=budget, prefill_chunk_size=chunk,
        scheduling_policy=s.scheduling_policy, batching=s.batching,
        enable_prefix_caching=c.enable_prefix_caching,
        prefix_cache_granularity=c.prefix_cache_granularity)


def default_num_blocks(mc, block_size, dtype, max_num_seqs, max_model_len, budget,
                       kv_cache_dtype="auto") -> int:
    if budget is None:
        if jax.default_backend() == "cpu":
            budget = CPU_KV_BUDGET_BYTES
        else:
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 16 << 30) - stats.get("bytes_in_use", 0)
            budget = int(free * GPU_KV_MEMORY_FRACTION)
    useful = max_num_seqs * -(-max_model_len // block_size) + 1
    return int(min(blocks_for_budget(mc, block_size, dtype, budget, kv_cache_dtype), useful))


def cache_namespace(loaded: LoadedModel, config: EngineConfig, param_dtype) -> str:
    """What the KV depends on besides the tokens: cached blocks are keyed under it."""
    return (f"{loaded.source}|{param_dtype}|{loaded.config}|block_size={config.cache.block_size}"
            f"|kv={config.cache.kv_cache_dtype}|weights={config.model.quantization}")


def speculative_planner(spec: SpeculativeConfig | None, config: EngineConfig,
                        sched: SchedulerConfig, vocab_size: int,
                        engine_class) -> SpeculativePlanner | None:
    """The planner the scheduler is handed; a draft model runs as an engine of its own
    (`engine_class`, passed in so that spec_decode never imports the engine)."""
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft_model":
        rt = config.runtime
        proposer = DraftModelProposer(
            spec.model, engine_class, target_vocab_size=vocab_size,
            max_num_seqs=spec.max_batch_size, max_model_len=sched.max_model_len,
            dtype=config.model.dtype, warmup=rt.warmup, warmup_runs=rt.warmup_runs,
            compilation_cache=rt.compilation_cache,
            attention_backend=rt.attention_backend, draft_sampling=spec.draft_sampling,
            unified_step=rt.unified_step)
    return SpeculativePlanner(spec, proposer)


def make_runner(config: EngineConfig, loaded: LoadedModel, sched: SchedulerConfig,
                devices=None) -> ModelRunner:
    tp = None
    if config.parallel.tensor_parallel_size != 1 or devices is not None:
        from jaxbatch.parallel.sharding import TensorParallel
        tp = TensorParallel(config.parallel.tensor_parallel_size, devices)
    rt = config.runtime
    runner_class, extra = ModelRunner, {}
    if config.lora.enable_lora:        # LoRA: the pool rides in every model call
        from jaxbatch.lora.runner import LoRARunner
        runner_class = LoRARunner
        extra = dict(max_loras=config.lora.max_loras, max_lora_rank=config.lora.max_lora_rank)
    runner = runner_class(loaded.config, loaded.params, sched, loaded.params["embed"].dtype,
                          rt.attention_backend, config.cache.kv_cache_dtype, tensor_parallel=tp,
                          lowered_dir=compile_cache.lowered_dir() if config.uses_lowered_store else None,
                          unified_step=rt.unified_step, kernel_options=kernel_options(config),
                          **extra)
    if loaded.private and tp is None:
        # Weights this engine loaded for itself: kept once, in the runner's form.
        loaded.params = runner.params
    return runner


def kernel_options(config: EngineConfig) -> KernelOptions:
    rt = config.runtime
    return KernelOptions(cpu_kernels=rt.cpu_kernels, kv_prefetch=rt.kv_prefetch,
                         weight_layout=rt.weight_layout, cpu_gemm=rt.cpu_gemm,
                         int8_activations=config.model.quantization == "w8a8")


def reasoning_parser(config: EngineConfig, tokenizer) -> ReasoningParser | None:
    """The reasoning model's thought tags (jaxbatch/reasoning/), or None without the option;
    a tokenizer without them is a ValueError here, before the runner is built."""
    return get_reasoning_parser(config.model.reasoning_parser, tokenizer)


def lora_manager(config: EngineConfig, runner: ModelRunner, scheduler):
    """LoRA engines: the adapter manager, wired as the scheduler's admission seam (its loads
    and slots reach the runner in the plans); None without enable_lora."""
    if not config.lora.enable_lora:
        return None
    from jaxbatch.lora.setup import make_manager
    # (A runner= without LoRA was refused before loading: EngineConfig.check_engine_args.)
    manager = make_manager(runner, config.lora.max_cpu_loras)
    scheduler.admission = manager
    return manager


def check_shared_runner(runner: ModelRunner, sched: SchedulerConfig,
                        config: EngineConfig) -> None:
    """`runner=` reuses another engine's compiled steps and pool: same shapes only."""
    mine = (sched.max_num_seqs, sched.num_blocks, sched.block_size, sched.max_model_len,
            sched.prefill_chunk_size, config.cache.kv_cache_dtype,
            int8_weights(config.model.quantization),
            config.runtime.unified_step and runner.attention.mixed_calls)
    theirs = (runner.cfg.max_num_seqs, runner.cfg.num_blocks, runner.cfg.block_size,
              runner.cfg.max_model_len, runner.cfg.prefill_chunk_size, runner.kv_cache_dtype,
              params_are_quantized(runner.params), runner.layout.unified)
    if mine != theirs:
        raise ValueError("runner= needs the same max_num_seqs, num_blocks, block_size, "
                         "max_model_len, prefill chunk size, kv_cache_dtype, "
                         "quantization and unified_step as this engine")


def kv_events(config: EngineConfig, sched: SchedulerConfig, scheduler, lora):
    """The KV event recorder (jaxbatch/kv_events/), attached to the prefix cache as its
    observer and publishing through ZMQ; a recorder that records nothing unless
    kv_events_config enables events."""
    events = KVEventsConfig.from_dict(config.cache.kv_events_config)
    if events is None or not events.publishes:
        return NO_KV_EVENTS
    if sched.prefix_cache_granularity == "chunk":
        logger.warning(
            "kv_events_config with prefix_cache_granularity='chunk': a router reads every "
            "published block as a hit, but this engine serves hits only in whole prefill chunks "
            "(%d tokens) and caches only blocks of full chunks; set "
            "prefix_cache_granularity='block' behind a KV-event router", sched.prefill_chunk_size)
    try:
        from jaxbatch.kv_events.publisher import ZmqEventPublisher
        from jaxbatch.kv_events.recorder import KVEventRecorder
    except ImportError as e:
        raise ValueError(f"kv_events_config needs pyzmq, msgspec and cbor2 "
                         f"(pip install 'jaxbatch[kv-events]'): {e}") from None
    recorder = KVEventRecorder(events, sched.block_size, ZmqEventPublisher(events),
                               lambda seq: block_origin(seq, lora),
                               memo_size=max(1 << 16, 4 * sched.num_blocks))
    scheduler.kv_cache.observe(recorder)
    return recorder


def block_origin(seq, lora):
    """What vLLM hashes besides a sequence's tokens: its adapter (from the LoRA manager, or
    None) and the salt its user gave (the engine's salt also names the adapter)."""
    from jaxbatch.kv_events.recorder import BlockOrigin
    request = lora.known.get(seq.lora_int_id) if lora is not None else None
    salt = user_cache_salt(seq.params.cache_salt, request)
    if request is None:
        return BlockOrigin(cache_salt=salt)
    return BlockOrigin(request.lora_int_id, request.lora_name, request.lora_path, salt)
