"""The engine's steps against the physical floor of this machine, measured in the same run.

Probes: copy bandwidth (an in-place pass over 512 MB), read bandwidth (a max over 512 MB, a
numpy call per core), GEMM peak (a 2048^3 matmul, the fastest form here; int8 for w8a8). A
decode step's floor: the larger of (weight + KV bytes) / copy bandwidth and its matmul FLOPs /
GEMM peak; its sequential floor adds the KV read at the read rate to the matmuls'; a prefill
chunk's (one request's one step): its FLOPs / GEMM peak. Decode: `rows` requests in lockstep,
lengths in (ctx/2, ctx]; --steps rounds of one step without host/device overlap, then with it.

    jaxbatch bench roofline [--rows 16 64] [--random-model 1B] [--quantization w8a8]"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch import LLMEngine, SamplingParams
from jaxbatch.benchmarks.base import Benchmark, add_flags
from jaxbatch.benchmarks.harness import drive
from jaxbatch.benchmarks.machine import cpu_count
from jaxbatch.benchmarks.random_models import add_model_arguments, load_bench_model
from jaxbatch.benchmarks.report import table


def _best_seconds(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 10) -> float:
    """Bytes per second of a pass that reads a float32 array and writes it back in place (the
    input donated: a fresh output buffer would add first-touch page faults to the time)."""
    step = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = jax.block_until_ready(step(jnp.ones(nbytes // 4, jnp.float32)))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x = jax.block_until_ready(step(x))
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 10) -> float:
    """Bytes per second of reading a float32 array once: a max over it, split into one part
    per core, each part's `np.max` on its own thread (numpy's loops release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    cores = cpu_count()
    parts = np.array_split(np.empty(nbytes // 4, np.float32), cores)
    best = float("inf")
    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(lambda part: part.fill(1.0), parts))   # each part's pages near its reader
        for _ in range(reps):
            start = time.perf_counter()
            list(pool.map(np.max, parts))
            best = min(best, time.perf_counter() - start)
    return nbytes / best


def gemm_peak(dtype="bfloat16", n: int = 2048, quantization=None) -> float:
    """FLOP/s of an n^3 `dtype` x `dtype` -> f32 matmul: the fastest of XLA's dot and the
    seam's forms that run here (our packed GEMM on AVX512, and on AMX tiles where the CPU has
    them), so the floor is the fastest a step could take; for w8a8, the seam's int8 forms'."""
    from cpu_kernels import packed_gemm, w8a8_gemm
    from jaxbatch.worker.kernel_forms import (AmxPacked, AmxPackedW8A8, OutInW8A8, Packed,
                                              PackedW8A8)
    apply = jax.jit(lambda x, form: form.apply(x, out_dtype=jnp.float32))
    a = jnp.ones((n, n), dtype)
    if quantization == "w8a8":
        w = (np.ones((n, n), np.int8), np.ones(n, np.float32))
        forms = [PackedW8A8, OutInW8A8] + [AmxPackedW8A8] * (w8a8_gemm.amx_why_not() is None)
        return 2 * n ** 3 / min(_best_seconds(apply, a, form.of(*w)) for form in forms)
    best = _best_seconds(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)),
                         a, a)
    if packed_gemm.why_not(dtype, n, n) is None:
        amx = jnp.dtype(dtype) == jnp.bfloat16 and packed_gemm.amx_why_not() is None
        w = np.ones((n, n), dtype)
        best = min([best] + [_best_seconds(apply, a, form.of(w, a))
                             for form in [Packed] + [AmxPacked] * amx])
    return 2 * n ** 3 / best


def model_bytes(params) -> int:
    """The weight bytes a decode step reads: every leaf, but not a tied embedding table beside
    its head's packed copy (`tied_head`): the step gathers a few rows of it."""
    skip = "embed" if "tied_head" in params else None
    return sum(x.nbytes for key, value in params.items() if key != skip
               for x in jax.tree.leaves(value))


def matmul_params(cfg) -> int:
    """Parameters of every layer matrix (embedding lookup and LM head excluded)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer


def kv_bytes_read(engine, lengths) -> int:
    """The KV bytes a decode step over sequences of these lengths reads."""
    cfg, itemsize = engine.model_config, np.dtype(engine.runner.pool[0].dtype).itemsize
    return int(sum(lengths)) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def decode_flops(cfg, rows: int) -> int:
    """Matmul FLOPs of one decode step: every layer matrix and the LM head, once per row."""
    return 2 * (matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size) * rows


def steady_decode_engine(loaded, slots, ctx, rounds, seed, **options):
    """An engine with `slots` requests that will decode in lockstep for rounds + 2 steps, every
    length inside (ctx/2, ctx], every prefill in the first step; no host/device overlap, so a
    step is timed whole. `options`: more engine options (quantization, cpu_gemm)."""
    engine = LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=ctx,
                       num_blocks=slots * (ctx // 16) + 1, prefill_chunk_size=ctx,
                       max_num_batched_tokens=slots * ctx + slots, warmup=False,
                       async_scheduling=False, **options)
    rng, vocab = np.random.default_rng(seed), engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=rounds + 3, ignore_eos=True)
    for i in range(slots):
        engine.add_request(f"r{i}", rng.integers(0, vocab, ctx - (rounds + 3)).tolist(), params)
    return engine


# Engine steps per timed round of `decode_rows`: one that reads back the overlapped step still
# in flight, the timed one without overlap, one that dispatches, and OVERLAPPED_STEPS timed.
OVERLAPPED_STEPS = 2
ROUND_STEPS = 3 + OVERLAPPED_STEPS


def decode_rows(loaded, rows: int, ctx: int, steps: int, bandwidth: float, peak: float,
                read_bandwidth: float, **options) -> dict:
    """`steps` rounds, each one step timed without overlap and OVERLAPPED_STEPS with it, in
    one engine: interleaved, so a slow moment of the machine hits both alike."""
    engine = steady_decode_engine(loaded, rows, ctx, ROUND_STEPS * steps, seed=0, **options)
    engine.step()                                    # every prefill
    engine.step()                                    # first decode: compiles it
    times, periods, kv = [], [], []
    for _ in range(steps):
        engine.async_scheduling = False
        engine.step()
        kv.append(kv_bytes_read(engine, [s.num_tokens for s in engine.scheduler.running]))
        times.append(timed_steps(engine, rows, 1))
        periods.append(overlapped_period(engine, rows, OVERLAPPED_STEPS))
    weights, kv_read = model_bytes(engine.runner.params), statistics.median(kv)
    bandwidth_floor = (weights + kv_read) / bandwidth
    compute_floor = decode_flops(engine.model_config, rows) / peak
    floor = max(bandwidth_floor, compute_floor)
    sequential = max(weights / read_bandwidth, compute_floor) + kv_read / read_bandwidth
    step, period = statistics.median(times), statistics.median(periods)
    return {"rows": rows, "context": ctx, "step_ms": 1e3 * step, "weight_mb": weights / 1e6,
            "kv_mb": kv_read / 1e6, "overlapped_step_ms": 1e3 * period,
            "bandwidth_floor_ms": 1e3 * bandwidth_floor, "compute_floor_ms": 1e3 * compute_floor,
            "bound": "bandwidth" if bandwidth_floor >= compute_floor else "compute",
            "floor_ms": 1e3 * floor, "step_over_floor": step / floor,
            "overlapped_over_floor": period / floor, "sequential_floor_ms": 1e3 * sequential,
            "overlapped_over_sequential": period / sequential,
            "overlapped_over_bandwidth_floor": period / bandwidth_floor,
            "reachable_over_bandwidth_floor": floor / bandwidth_floor}


def overlapped_period(engine, rows: int, steps: int) -> float:
    """Seconds per step with host/device overlap on (each `step()` dispatches the next step and
    reads the previous): a running engine's decode period; the first call only dispatches."""
    engine.async_scheduling = True
    engine.step()
    return timed_steps(engine, rows, steps)


def timed_steps(engine, rows: int, steps: int) -> float:
    """Seconds per step of `steps` `step()` calls, each of which must dispatch a decode step of
    all `rows` sequences: a step of fewer rows would be a smaller step than the one named."""
    first, start = len(engine.step_log), time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    dispatched = engine.step_log[first:]
    if len(dispatched) != steps or any(num_seqs != rows for _, num_seqs, _, _ in dispatched):
        raise RuntimeError(f"{rows} rows: left steady decode in a timed step")
    return seconds


def prefill_chunk(loaded, tokens: int, peak: float, **options) -> dict:
    engine = LLMEngine(loaded=loaded, max_num_seqs=4, max_model_len=2 * tokens,
                       prefill_chunk_size=tokens, warmup=False, async_scheduling=False,
                       enable_prefix_caching=False, **options)
    rng, vocab = np.random.default_rng(0), engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # One request at a time, whole in one step: that step's seconds (drive's first step entry).
    times = [drive(engine, [(rng.integers(3, vocab, tokens).tolist(), params)])["steps"][0][0]
             for _ in range(4)]
    step = min(times[1:])                              # the first one compiled
    flops = 2 * matmul_params(engine.model_config) * tokens
    return {"tokens": tokens, "step_ms": 1e3 * step, "gflop": flops / 1e9,
            "floor_ms": 1e3 * flops / peak, "step_over_floor": step * peak / flops}


# The tables' columns: (head, cell as a format string over a decode_rows / prefill_chunk entry).
DECODE_COLUMNS = (
    ("decode rows", "{rows}"), ("context", "{context}"), ("step ms", "{step_ms:.1f}"),
    ("overlapped step ms", "{overlapped_step_ms:.1f}"), ("weights MB", "{weight_mb:.0f}"),
    ("KV read MB", "{kv_mb:.0f}"), ("bandwidth floor ms", "{bandwidth_floor_ms:.1f}"),
    ("compute floor ms", "{compute_floor_ms:.1f}"),
    ("step / floor", "{step_over_floor:.2f} ({bound})"),
    ("overlapped / floor", "{overlapped_over_floor:.2f}"),
    ("sequential floor at read rate ms", "{sequential_floor_ms:.1f}"),
    ("overlapped / sequential", "{overlapped_over_sequential:.2f}"),
    ("overlapped / bandwidth floor", "{overlapped_over_bandwidth_floor:.2f}"),
    ("reachable / bandwidth floor", "{reachable_over_bandwidth_floor:.2f}"))
PREFILL_COLUMNS = (
    ("prefill tokens", "{tokens}"), ("step ms", "{step_ms:.1f}"), ("GFLOP", "{gflop:.1f}"),
    ("floor ms", "{floor_ms:.1f}"), ("step / floor", "{step_over_floor:.2f}"))


class Roofline(Benchmark):
    name = "roofline"

    def add_arguments(self, ap) -> None:
        ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
        add_flags(ap, context=(256, "a power of two"), prefill_tokens=256,
                  steps=(20, "timed rounds per row count"))
        ap.add_argument("--quantization", default=None, choices=("int8", "w8a8"))
        ap.add_argument("--cpu-gemm", default="auto", choices=("auto", "amx", "packed", "xla"),
                        help="the engine's cpu_gemm: which kernel runs the matmuls")
        add_model_arguments(ap)

    def check(self, args):
        ctx = args.context
        if args.steps < 1:
            return "--steps must be at least 1"
        if ctx & (ctx - 1) or ctx - (ROUND_STEPS * args.steps + 3) <= ctx // 2:
            return (f"--context {ctx}: a power of two > 2 * ({ROUND_STEPS} * steps + 3), so "
                    f"every length stays in one page bucket through every timed step")
        return None

    def load(self, args):
        return load_bench_model(args)

    def bench(self, loaded, args) -> dict:
        dtype = loaded.params["embed"].dtype    # the matmuls' (int8 weights dequantize to it)
        bandwidth, reads = copy_bandwidth(), read_bandwidth()
        peak = gemm_peak(dtype, quantization=args.quantization)
        gemm = "int8 (w8a8)" if args.quantization == "w8a8" else str(dtype)
        print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, read bandwidth {reads / 1e9:.1f} GB/s,"
              f" {gemm} GEMM peak {peak / 1e12:.2f} TFLOP/s", flush=True)
        options = {"quantization": args.quantization, "cpu_gemm": args.cpu_gemm}
        return {"model": loaded.source, "weights": args.quantization or str(dtype),
                "cpu_gemm": args.cpu_gemm, "copy_bandwidth_bytes_s": bandwidth,
                "read_bandwidth_bytes_s": reads, "gemm_peak_flop_s": peak, "gemm_dtype": gemm,
                "decode": [decode_rows(loaded, rows, args.context, args.steps, bandwidth, peak,
                                       reads, **options) for rows in args.rows],
                "prefill": prefill_chunk(loaded, args.prefill_tokens, peak, **options)}

    def markdown(self, report) -> str:
        def rows(columns, entries):
            return table([head for head, _ in columns],
                         [[form.format(**e) for _, form in columns] for e in entries])
        return "\n\n".join([
            f"copy bandwidth {report['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s; read bandwidth "
            f"{report['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s; {report['gemm_dtype']} GEMM "
            f"peak {report['gemm_peak_flop_s'] / 1e12:.2f} TFLOP/s; {report['model']}, weights "
            f"{report['weights']}, cpu_gemm {report.get('cpu_gemm', 'auto')}",
            rows(DECODE_COLUMNS, report["decode"]), rows(PREFILL_COLUMNS, [report["prefill"]])])


main = Roofline().main
