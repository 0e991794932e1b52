"""Every engine option, once: its name, default, help text and check.

The options are grouped by the room that uses them (model, cache, scheduler, speculative,
parallel, runtime). `LLM(...)`, `LLMEngine(...)` and `build_engine(...)` take them as keyword
arguments (`EngineConfig.from_kwargs`); `jaxbatch serve` gets one flag per option from
`add_engine_flags`, dashes for underscores (vLLM's spelling), and the README's option table is
checked against the same list (tests/engine/test_config.py). Pure Python, no I/O: sizes that
need the model or the device (`max_model_len=None`, `num_blocks=None`) are resolved when the
engine is built (`engine/setup.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from jaxbatch.kv_events.config import KVEventsConfig
from jaxbatch.spec_decode.speculative import SpeculativeConfig

POLICIES = ("fcfs", "priority", "shortest_prompt_first")
BATCHING_MODES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")
KV_CACHE_DTYPES = ("auto", "int8")
QUANTIZATION_METHODS = ("int8", "w8a8")          # what a --quantization flag may name
QUANTIZATIONS = (None, *QUANTIZATION_METHODS)
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_KERNEL_MODES = ("auto", "off", "required")
CPU_GEMMS = ("auto", "amx", "packed", "xla")
WEIGHT_LAYOUTS = ("auto", "per_layer", "stacked")
RUNNERS = ("generate", "pooling")
POOLING_TYPES = (None, "last", "mean", "cls")
NON_NEGATIVE = ("seed", "process_id")
REASONING_PARSERS = (None, "qwen3", "deepseek_r1")     # jaxbatch/reasoning/parser.py


def option(default, help: str, choices: tuple | None = None, positional: bool = False):
    """A dataclass field carrying what a flag needs besides its name."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "positional": positional})


def int_at_least(low: int):
    """An argparse type: an integer >= low (argparse's error then names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    model: str | None = option(
        None, "HF directory or .gguf file; omitted: the embedded SmolLM2-135M-Instruct",
        positional=True)
    dtype: str = option("auto", "weights and activations dtype; auto: bfloat16 for a 16-bit "
                        "checkpoint on an accelerator or a CPU with native bf16 dots (AMX, "
                        "AVX512-BF16), float32 otherwise (stats()['dtype'] says which)", DTYPES)
    quantization: str | None = option(
        None, "int8: weight-only int8 layer matrices, one scale per output channel; w8a8: "
        "the same weights against activations quantized to int8 per token in the matmul "
        "(int32 sums; on CPUs with AVX512-VNNI, or a GPU)",
        QUANTIZATIONS)
    reasoning_parser: str | None = option(
        None, "a reasoning model's thought (between its think tags) goes to the output's "
        "reasoning, not its text, and a grammar starts after it", REASONING_PARSERS)


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    block_size: int = option(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = option(None, "KV blocks in the pool; None: sized from "
                                    "kv_cache_memory_bytes")
    kv_cache_memory_bytes: int | None = option(
        None, "pool budget when num_blocks is None (1 GiB on CPU, half the free device "
        "memory on GPU)")
    kv_cache_dtype: str = option("auto", "int8: KV cache as int8 with a float32 scale per "
                                 "token and KV head", KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(
        True, "share the KV of prompt prefixes already computed")
    prefix_cache_granularity: str = option(
        "chunk", "chunk: prefix hits in whole prefill chunks, outputs exactly as with the "
        "cache off; block: in whole blocks, as vLLM (short system prompts shared too)",
        ("chunk", "block"))
    kv_events_config: dict | None = option(
        None, 'publish what enters and leaves the prefix cache as vLLM\'s KV events, as JSON '
        'with vLLM\'s keys: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"} (docs/deploy.md)')


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = option(32, "slots in the decode batch")
    max_model_len: int | None = option(None, "longest sequence (prompt + output); None: the "
                                       "model's, at most 8192")
    max_num_batched_tokens: int | None = option(
        None, "per-step token budget (decode + prefill chunk tokens); None: max_num_seqs + "
        "prefill_chunk_size")
    prefill_chunk_size: int | None = option(
        None, "tokens per prefill chunk (a power of two); None: 256, or what fits the budget")
    scheduling_policy: str = option("fcfs", "order of admission and preemption", POLICIES)
    batching: str = option("continuous", "static: admit a new group only when the whole "
                           "previous group has finished (the baseline)", BATCHING_MODES)
    async_scheduling: bool = option(
        True, "plan each step while the previous one runs on the device (outputs are the "
        "same without it)")


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    speculative_config: dict | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3} '
        'or {"method": "draft_model", "model": PATH, "draft_sampling": "sampled"}')


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    tensor_parallel_size: int = option(1, "split the model over this many devices (every "
                                       "process's, with num_processes)")
    data_parallel_size: int = option(1, "independent engine replicas; each request goes to the "
                                     "replica with the least outstanding work")
    num_processes: int = option(1, "processes (hosts) joined by jax.distributed into one "
                                "engine; process 0 takes the requests, the others follow")
    process_id: int = option(0, "this process's index among num_processes")
    coordinator_address: str | None = option(None, "HOST:PORT of process 0's jax.distributed "
                                             "coordinator")


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    seed: int = option(0, "seeds the per-request seeds of requests that give none")
    attention_backend: str = option("auto", "auto: pallas on a GPU whose jax lowers the "
                                    "kernels, xla elsewhere", ATTENTION_BACKENDS)
    warmup: bool = option(True, "compile every step shape before the first request, so nothing "
                          "compiles while serving")
    warmup_runs: bool = option(True, "with warmup, also run each model step shape once (on "
                               "inputs that touch no request): XLA:CPU sets up an "
                               "executable's kernels on its first run, which the first "
                               "requests of each shape would otherwise wait for")
    unified_step: bool = option(True, "run a full decode batch and the step's prefill chunks "
                                "as one model call, one pass over the weights (xla backend; "
                                "one more executable per prefill token bucket); off: a call "
                                "each")
    compilation_cache: bool = option(True, "keep compiled and lowered steps on disk "
                                     "(~/.cache/jaxbatch, or $JAXBATCH_CACHE)")
    cpu_kernels: str = option("auto", "our C++ kernels on a CPU (GEMM over packed weights, "
                              "add + norm, paged attention, argmax): auto where they run, off, "
                              "or required (an error where one cannot run); stats()['kernels'] "
                              "says what runs each operation and why", CPU_KERNEL_MODES)
    kv_prefetch: bool = option(True, "the C++ decode attention names the next layer's KV pages "
                               "to the GEMMs before it, which request them into cache where "
                               "they run on AVX512 (cpu_gemm packed; results are the same "
                               "either way)")
    cpu_gemm: str = option("auto", "a bf16 or w8a8 model's matmuls on a CPU: our kernels over "
                           "packed weights on amx (AMX tiles; an error where they cannot run "
                           "or apply) or packed (AVX512-BF16 / VNNI), xla (XLA's dots), or "
                           "auto: amx where the CPU has AMX, else packed; decode attention's "
                           "q.K and p.V take AMX tiles under amx where its pages fit them, "
                           "under auto where a kv head also has 8 or more query heads",
                           CPU_GEMMS)
    weight_layout: str = option("auto", "layer matrices kept apart per layer (auto on a CPU: "
                                "each matmul reads its weight in place) or stacked [L, in, out] "
                                "(auto elsewhere)", WEIGHT_LAYOUTS)


@dataclasses.dataclass(frozen=True)
class LoRAOptions:
    enable_lora: bool = option(False, "serve PEFT LoRA adapters (lora_request=, or a server "
                               "request's model naming one); every model call then also "
                               "takes the adapter pool")
    max_loras: int = option(4, "adapters resident on the device at once (one step may mix "
                            "them all)")
    max_lora_rank: int = option(16, "highest adapter rank accepted (the pool's padded rank)")
    max_cpu_loras: int | None = option(None, "adapters kept in host memory besides those in "
                                       "use; None: max_loras")


@dataclasses.dataclass(frozen=True)
class PoolingOptions:
    runner: str = option("generate", "generate: text; pooling: embeddings (LLM.embed, "
                         "/v1/embeddings), prefill only, no text generated", RUNNERS)
    pooling_type: str | None = option(
        None, "pooling runner: how hidden states become one vector (last token, mean, CLS); "
        "None: the checkpoint's sentence-transformers config, else last", POOLING_TYPES)
    pooling_normalize: bool | None = option(
        None, "pooling runner: scale embeddings to unit length; None: as the checkpoint's "
        "sentence-transformers modules say, else yes")


GROUPS = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions,
          "speculative": SpeculativeOptions, "parallel": ParallelOptions,
          "runtime": RuntimeOptions, "lora": LoRAOptions,
          "pooling": PoolingOptions}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = dataclasses.field(default_factory=SchedulerOptions)
    speculative: SpeculativeOptions = dataclasses.field(default_factory=SpeculativeOptions)
    parallel: ParallelOptions = dataclasses.field(default_factory=ParallelOptions)
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    lora: LoRAOptions = dataclasses.field(default_factory=LoRAOptions)
    pooling: PoolingOptions = dataclasses.field(default_factory=PoolingOptions)

    def __post_init__(self):
        for name, value in self.as_kwargs().items():
            _check(name, value, OPTIONS[name])
        _check_tensor_parallel(self)
        _check_lora(self)
        _check_pooling(self)
        _check_kv_events(self)
        SpeculativeConfig.from_dict(self.speculative.speculative_config)   # raises if invalid

    # ---- cross-feature checks: every one here, so a refused combination fails before
    # anything loads ----------------------------------------------------------------------------
    def check_engine_args(self, *, runner=None, devices=None) -> None:
        """What `LLMEngine(runner=, devices=)` adds to the options, checked before loading:
        `devices` splits the model over them (tensor parallelism, even over one); `runner`
        reuses another engine's runner, which a LoRA engine needs built with LoRA."""
        if devices is not None:
            _check_tensor_parallel(self, "devices=")
            if self.lora.enable_lora:
                raise ValueError("enable_lora=True is not supported with devices= "
                                 "(tensor parallelism)")
        if runner is not None and self.lora.enable_lora and not hasattr(runner, "lora_pool"):
            raise ValueError("enable_lora=True cannot reuse a runner= built without it")

    @property
    def uses_lowered_store(self) -> bool:
        """Lowered step functions kept between starts (worker/lowered_store.py): with the
        compilation cache, not for LoRA engines (stored lowerings are keyed without the LoRA
        inputs)."""
        return self.runtime.compilation_cache and not self.lora.enable_lora

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        unknown = sorted(set(kwargs) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(OPTIONS)}")
        groups = {}
        for group, kind in GROUPS.items():
            names = {f.name for f in dataclasses.fields(kind)}
            groups[group] = kind(**{k: v for k, v in kwargs.items() if k in names})
        return cls(**groups)

    def as_kwargs(self) -> dict[str, Any]:
        """Every option by name (the flat form LLM(...) takes)."""
        return {f.name: getattr(getattr(self, group), f.name)
                for group in GROUPS for f in dataclasses.fields(getattr(self, group))}

    def replace(self, **kwargs) -> "EngineConfig":
        return EngineConfig.from_kwargs(**{**self.as_kwargs(), **kwargs})


# name -> dataclasses.Field, in declaration order.
OPTIONS: dict[str, dataclasses.Field] = {
    f.name: f for kind in GROUPS.values() for f in dataclasses.fields(kind)}


def _check(name: str, value, field: dataclasses.Field) -> None:
    choices = field.metadata["choices"]
    if choices is not None and value not in choices:
        raise ValueError(f"{name}={value!r}; choose one of "
                         f"{', '.join(str(c) for c in choices)}")
    if field.type in ("int", "int | None") and value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < (
                0 if name in NON_NEGATIVE else 1):
            raise ValueError(f"{name}={value!r} must be "
                             f"{'>= 0' if name in NON_NEGATIVE else 'a positive integer'}")
    if field.type == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    if field.type == "bool | None" and value not in (None, True, False):
        raise ValueError(f"{name}={value!r} must be True, False or None")


def _check_tensor_parallel(config: "EngineConfig", how: str | None = None) -> None:
    """Tensor parallelism (`how`: what asks for it; None: tensor_parallel_size > 1) splits float
    weights and a float cache only."""
    if how is None and config.parallel.tensor_parallel_size == 1:
        return
    if config.cache.kv_cache_dtype != "auto" or config.model.quantization is not None:
        raise ValueError(f"{how or 'tensor_parallel_size > 1'} with an int8 KV cache or int8 "
                         "weights is not supported yet")


def _check_lora(config: "EngineConfig") -> None:
    """What LoRA serving does not combine with (yet): refused, not ignored."""
    if not config.lora.enable_lora:
        return
    par = config.parallel
    refused = [name for name, on in (
        ("tensor_parallel_size > 1", par.tensor_parallel_size > 1),
        ("data_parallel_size > 1", par.data_parallel_size > 1),
        ("num_processes > 1", par.num_processes > 1),
        ("speculative_config", config.speculative.speculative_config is not None)) if on]
    if refused:
        raise ValueError(f"enable_lora=True is not supported with {', '.join(refused)}")
    cpu = config.lora.max_cpu_loras
    if cpu is not None and cpu < config.lora.max_loras:
        raise ValueError(f"max_cpu_loras={cpu} must be >= max_loras={config.lora.max_loras}")


def _check_pooling(config: "EngineConfig") -> None:
    """The pooling options belong to the pooling runner; what it does not combine with (yet)
    is refused, not ignored."""
    p = config.pooling
    if p.runner != "pooling":
        given = [name for name, value in (("pooling_type", p.pooling_type),
                                          ("pooling_normalize", p.pooling_normalize))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} needs runner='pooling'")
        return
    par = config.parallel
    refused = [name for name, on in (
        ("tensor_parallel_size > 1", par.tensor_parallel_size > 1),
        ("data_parallel_size > 1", par.data_parallel_size > 1),
        ("num_processes > 1", par.num_processes > 1),
        ("enable_lora", config.lora.enable_lora),
        ("speculative_config", config.speculative.speculative_config is not None)) if on]
    if refused:
        raise ValueError(f"runner='pooling' is not supported with {', '.join(refused)}")
def _check_kv_events(config: "EngineConfig") -> None:
    """KV events describe the prefix cache of one engine process."""
    events = KVEventsConfig.from_dict(config.cache.kv_events_config)    # raises if invalid
    if events is None or not events.publishes:
        return
    if not config.cache.enable_prefix_caching:
        raise ValueError("kv_events_config publishes the prefix cache's blocks: it needs "
                         "enable_prefix_caching=True")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (the model is the positional argument), defaults shown."""
    for name, field in OPTIONS.items():
        meta = field.metadata
        if meta["positional"]:
            parser.add_argument(name, nargs="?", default=field.default, help=meta["help"])
            continue
        kwargs: dict[str, Any] = {"default": field.default, "help": meta["help"], "dest": name}
        if field.type in ("bool", "bool | None"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.type.startswith("int"):
            kwargs["type"] = int_at_least(0 if name in NON_NEGATIVE else 1)
        elif field.type.startswith("dict"):
            kwargs["type"] = _json_object
        if meta["choices"] is not None:
            kwargs["choices"] = [c for c in meta["choices"] if c is not None]
        parser.add_argument(flag_name(name), **kwargs)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as LLM(...) keyword arguments."""
    return {name: getattr(args, name) for name in OPTIONS}


def options_markdown() -> str:
    """The README's option table (tests/engine/test_config.py keeps the README equal to it):
    `python -c "from jaxbatch.engine.config import options_markdown; print(options_markdown())"`."""
    rows = ["| option | `jaxbatch serve` | default | what |", "|---|---|---|---|"]
    for name, field in OPTIONS.items():
        flag = "MODEL (positional)" if field.metadata["positional"] else f"`{flag_name(name)}`"
        rows.append(f"| `{name}` | {flag} | `{field.default!r}` | {field.metadata['help']} |")
    return "\n".join(rows)
