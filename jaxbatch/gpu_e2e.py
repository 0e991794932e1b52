"""End-to-end decode speed of the engine on random-weight models of real shapes, on a GPU, and a
check that its greedy outputs with the Pallas kernels equal those of the plain-reference path.

    python -m jaxbatch.gpu_e2e --out DIR [--models small 1B 8B] [--budget-s 150]
    python -m jaxbatch.gpu_e2e --out DIR --dry-run          # CPU, tiny shapes, interpret mode

For each model shape (bf16, weights from jax.random in the engine's params layout, no tokenizer,
token-id prompts):
  speed   `slots` requests of `prompt_len` random tokens, `new_tokens` greedy tokens each
          (ignore_eos). An untimed run of the same requests compiles exactly the executables
          the timed run needs (scheduling is deterministic), so the timed run compiles nothing
          (`engine.warmup()` would compile every bucket: minutes for an 8B model). Reports end-to-end output tokens/s (prefill included) and decode tokens/s
          over the steps where every slot decodes.
  check   the first `check_requests` prompts through a second engine on the same weights with
          attention_backend="reference"; its greedy tokens must equal the first `check_tokens`
          tokens the Pallas engine produced (greedy decoding is prefix-consistent).
JSON goes to DIR/gpu_e2e.json after every model, so a timeout keeps what finished; a short
table follows and the last line is a one-line summary (scripts/gpu_check.sh quotes it).
Models are skipped once `--budget-s` is spent. Helpers here (shapes, random params, copy
bandwidth) are shared with `scripts/bench.py --device gpu`.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel

# Real shapes: SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B; "tiny" is for CPU dry runs and tests.
MODEL_SHAPES = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
                        tie_word_embeddings=True),
    "small": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "1B": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      rope_theta=500000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192),
    "8B": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, tie_word_embeddings=False,
                      max_position_embeddings=8192),
}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


# ---- random weights ---------------------------------------------------------------------------

def _layer_init(cfg: ModelConfig, dtype):
    """A jitted key -> one layer's params. Projections ~ N(0, 1/fan_in) keep the residual stream
    at unit scale through depth, so bf16 neither overflows nor flattens the logits."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(shapes))
        layer = {name: (jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)
                 for k, (name, shape) in zip(keys, shapes.items())}
        layer["attn_norm"] = jnp.ones((d,), dtype)
        layer["mlp_norm"] = jnp.ones((d,), dtype)
        return layer
    return init


def random_params(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Params in `jaxbatch.model.llama`'s layout, built on the default device.

    Embeddings (and an untied lm_head) ~ N(0, 1): logits then have a spread of about
    sqrt(hidden_size), so greedy choices are rarely near-ties and a kernel-vs-reference
    comparison tests the kernels, not rounding luck."""
    if cfg.qkv_bias or cfg.o_bias:
        raise ValueError("random_params builds Llama-shaped models without biases")
    key = jax.random.key(seed)
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    init = _layer_init(cfg, dtype)
    normal = jax.jit(lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                     static_argnums=1)
    params = {"embed": normal(k_embed, (cfg.vocab_size, cfg.hidden_size)),
              "layers": [init(k) for k in jax.random.split(k_layers, cfg.num_layers)],
              "final_norm": jnp.ones((cfg.hidden_size,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal(k_head, (cfg.hidden_size, cfg.vocab_size))
    jax.block_until_ready(params)
    return params


def random_model(name: str, dtype: str = "bfloat16", seed: int = 0) -> LoadedModel:
    """A LoadedModel without tokenizer: prompts must be token-id lists."""
    start = time.perf_counter()
    cfg = MODEL_SHAPES[name]
    params = random_params(cfg, DTYPES[dtype], seed)
    return LoadedModel(cfg, params, tokenizer=None, source=f"random:{name}:{dtype}",
                       load_seconds=time.perf_counter() - start, from_cache=False)


def param_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s: a jitted x + 1 on a bf16 buffer reads and writes
    nbytes each; median of `reps` device-synchronised calls."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    bump = jax.jit(lambda a: a + 1)
    jax.block_until_ready(bump(x))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(bump(x))
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


# ---- runs ---------------------------------------------------------------------------------------

def make_engine(loaded: LoadedModel, slots: int, max_model_len: int, backend: str):
    from jaxbatch.engine import LLMEngine
    pages = -(-max_model_len // 16)
    # num_blocks sized to the run (not half the GPU): two engines on an 8B model must coexist.
    return LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=max_model_len,
                     num_blocks=slots * pages + 1, attention_backend=backend, warmup=False)


def generate(engine, prompts, new_tokens: int):
    """Runs prompts to completion; returns (token lists, seconds, per-step (seconds, seqs, tokens))."""
    from jaxbatch import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    start, previous = time.perf_counter(), time.monotonic()     # step-log times are monotonic
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    first_step = len(engine.step_log)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    steps = []
    for when, seqs, _, tokens in engine.step_log[first_step:]:
        steps.append((when - previous, seqs, tokens))
        previous = when
    return [outputs[rid] for rid in ids], seconds, steps


def speed_run(loaded, slots, prompt_len, new_tokens, backend, seed):
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(slots)]
    engine = make_engine(loaded, slots, prompt_len + new_tokens, backend)
    generate(engine, prompts, new_tokens)      # untimed: compiles every bucket the run uses
    compiled = engine.stats()["num_compilations"]
    tokens, seconds, steps = generate(engine, prompts, new_tokens)
    decode = [(dt, n) for dt, seqs, n in steps[1:] if seqs == slots and n == slots]
    decode_s = sum(dt for dt, _ in decode)
    result = {
        "backend": engine.stats()["attention_backend"], "slots": slots, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "seconds": seconds,
        "e2e_output_tokens_per_s": slots * new_tokens / seconds,
        "decode_steps": len(decode),
        "decode_tokens_per_s": sum(n for _, n in decode) / decode_s if decode_s else None,
        "decode_step_ms_median": 1e3 * float(np.median([dt for dt, _ in decode])) if decode else None,
        "compilations_warmup": compiled,
        "compilations_timed": engine.stats()["num_compilations"] - compiled,
        "compile_seconds": engine.stats()["compile_seconds"],
    }
    del engine
    gc.collect()
    return result, prompts, tokens


def greedy_check(loaded, prompts, pallas_tokens, slots, max_model_len, check_tokens):
    engine = make_engine(loaded, slots, max_model_len, "reference")
    ref_tokens, _, _ = generate(engine, prompts, check_tokens)
    del engine
    gc.collect()
    mismatches = []
    for i, (ref, got) in enumerate(zip(ref_tokens, pallas_tokens)):
        got = got[:check_tokens]
        if ref != got:
            first = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
            mismatches.append({"request": i, "first_divergence": first,
                               "reference": ref[first:first + 4], "pallas": got[first:first + 4]})
    return {"requests": len(prompts), "tokens_each": check_tokens,
            "equal": not mismatches, "mismatches": mismatches}


def run_model(name, args, pallas_backend):
    start = time.perf_counter()
    loaded = random_model(name, args.dtype, args.seed)
    result = {"model": name, "dtype": args.dtype, "config": dataclasses.asdict(MODEL_SHAPES[name]),
              "param_bytes": param_bytes(loaded.params), "init_seconds": loaded.load_seconds}
    speed, prompts, tokens = speed_run(loaded, args.slots, args.prompt_len, args.new_tokens,
                                       pallas_backend, args.seed)
    result["speed"] = speed
    n = min(args.check_requests, len(prompts))
    result["check"] = greedy_check(loaded, prompts[:n], tokens[:n], args.slots,
                                   args.prompt_len + args.new_tokens, args.check_tokens)
    result["seconds"] = time.perf_counter() - start
    del loaded
    gc.collect()
    return result


# ---- report -------------------------------------------------------------------------------------

def table(results) -> str:
    lines = ["| model | backend | e2e tok/s | decode tok/s | decode step ms | compiles "
             "(warm-up / timed) | pallas == reference |", "|---" * 7 + "|"]
    for r in results:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['model']} | " + (r.get("error") or r["skipped"])[:80]
                         + " | | | | | |")
            continue
        s, c = r["speed"], r["check"]
        eq = "yes" if c["equal"] else f"NO ({len(c['mismatches'])}/{c['requests']} differ)"
        lines.append(f"| {r['model']} {r['dtype']} | {s['backend']} | "
                     f"{s['e2e_output_tokens_per_s']:.0f} | {s['decode_tokens_per_s'] or 0:.0f} | "
                     f"{s['decode_step_ms_median'] or 0:.2f} | {s['compilations_warmup']} / "
                     f"{s['compilations_timed']} | {eq} ({c['requests']}x{c['tokens_each']}) |")
    return "\n".join(lines)


def summary_line(results) -> str:
    parts = []
    for r in results:
        if "speed" in r:
            parts.append(f"{r['model']} {r['speed']['decode_tokens_per_s'] or 0:.0f} decode tok/s, "
                         f"match={'yes' if r['check']['equal'] else 'NO'}")
        else:
            parts.append(f"{r['model']} " + ("ERROR" if "error" in r else "skipped"))
    return "gpu_e2e: " + "; ".join(parts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shape, Pallas in interpret mode: checks this script only")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODEL_SHAPES),
                    help="default: small 1B 8B (tiny with --dry-run)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="no new model is started after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models = args.models or ["tiny"]
        args.slots, args.prompt_len = min(args.slots, 4), min(args.prompt_len, 32)
        args.new_tokens, args.check_requests = min(args.new_tokens, 8), min(args.check_requests, 2)
        args.check_tokens = min(args.check_tokens, args.new_tokens)
    args.models = args.models or ["small", "1B", "8B"]
    if args.check_tokens > args.new_tokens:
        ap.error("--check-tokens must be <= --new-tokens")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        print("gpu_e2e: no GPU (jax backend is %r); use --dry-run on CPU" % jax.default_backend())
        return 2
    pallas_backend = "pallas" if on_gpu else "pallas_interpret"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "jax": jax.__version__, "dry_run": args.dry_run, "args": vars(args), "models": []}
    if on_gpu:
        report["copy_GBps"] = copy_bandwidth(1 << 30) / 1e9
    start = time.perf_counter()
    for name in args.models:
        if time.perf_counter() - start > args.budget_s:
            report["models"].append({"model": name, "skipped": "time budget spent"})
            continue
        print(f"[gpu_e2e] {name}: random {args.dtype} weights, {args.slots} slots", flush=True)
        try:
            report["models"].append(run_model(name, args, pallas_backend))
        except Exception as e:        # keep going: one model's failure must not hide the others
            report["models"].append({"model": name, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
        (out_dir / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = time.perf_counter() - start
    (out_dir / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report["models"]))
    print(summary_line(report["models"]))
    ok = all("speed" in r and r["check"]["equal"] and r["speed"]["compilations_timed"] == 0
             for r in report["models"] if "skipped" not in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
