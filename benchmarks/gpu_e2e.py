"""End-to-end decode speed of the engine on random-weight models of real shapes, on a GPU, and a
check that its greedy outputs with the GPU attention equal those of the plain-reference path.

    python -m benchmarks.gpu_e2e --out DIR [--models small 1B 8B] [--budget-s 150]
    python -m benchmarks.gpu_e2e --out DIR --dry-run          # CPU, tiny shapes, interpret mode

For each model shape (bf16, weights from jax.random in the engine's stacked params layout, no
tokenizer, token-id prompts):
  speed   `slots` requests of `prompt_len` random tokens, `new_tokens` greedy tokens each
          (ignore_eos), on the backend `auto` picks (`pallas` where this jax's Triton backend
          works, else `xla`; `pallas_interpret` in a dry run). An untimed run of the same
          requests compiles exactly the executables the timed run needs (scheduling is
          deterministic), so the timed run compiles nothing (`engine.warmup()` would compile
          every bucket: minutes for an 8B model). Reports end-to-end output tokens/s (prefill
          included) and decode tokens/s over the steps where every slot decodes.
  check   the first `check_requests` prompts through a second engine on the same weights with
          attention_backend="reference". Greedy tokens must be identical, except that they may
          part where the reference's top-2 log-probabilities nearly tie (the rule of the CPU
          tests, `compare_greedy`): the gap must be below `near_tie_tolerance`, a relative
          tolerance (1e-3 as on CPU for float32, about one bf16 ulp for bfloat16) of the top
          logit of these random models. The same prompts are rerun on the timed backend with
          log-probabilities, which must match the reference's within the same tolerance for
          every token they agree on. Every divergence, accepted or not, is recorded with its gap.
          The random weights are scaled so that the next token depends on attention
          (`embedding_std`): with tied N(0, 1) embeddings a random model repeats its input
          token whatever attention computes, and the check would test nothing.
JSON goes to DIR/gpu_e2e.json after every model, so a timeout keeps what finished; a short
table follows and the last line is a one-line summary (scripts/gpu_check.sh quotes it).
Exit status: 0 all requested models ran and passed; 1 a check failed, a model raised, or the
timed run compiled; 3 a model was skipped because `--budget-s` was spent (incomplete).
GPU_CHECK_SIMULATE_FAILURE=e2e corrupts one token of the checked output, to prove the check
fails (scripts/gpu_check.sh --dry-run uses it). Helpers here (shapes, random params, copy
bandwidth) are shared with `jaxbatch bench throughput --device gpu` and the lowering tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jax.numpy as jnp

# The random models are the package's (roofline and lora run them); re-exported for the tests.
from jaxbatch.benchmarks.random_models import (  # noqa: F401
    DTYPES, MODEL_SHAPES, embedding_std, random_model, random_params)
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel


def logit_std(cfg: ModelConfig) -> float:
    """Spread of the logits of `random_params`: the unit-RMS final hidden state (norm sqrt(d))
    against output embeddings of std `embedding_std` (tied) or 1 (the untied lm_head)."""
    head_std = embedding_std(cfg) if cfg.tie_word_embeddings else 1.0
    return head_std * math.sqrt(cfg.hidden_size)


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



# Near-tie rule, relative to the top logit: float32 as the CPU tests (1e-3); bfloat16 2**-7,
# about one bf16 ulp (the logits come out of a bf16 matmul: at a top logit of ~290, for the
# 8B shape, neighbouring bf16 values are 2 apart, so an exact tie after rounding is common).
NEAR_TIE_REL = {"float32": 1e-3, "bfloat16": 2.0 ** -7}
CHECK_LOGPROBS = 5          # top-k log-probabilities recorded by the reference run


# ---- the greedy comparison ----------------------------------------------------------------------

def near_tie_tolerance(cfg: ModelConfig, dtype: str) -> float:
    """Largest top-2 log-probability gap (nats) at which two correct implementations may pick
    different greedy tokens, and the largest difference allowed between their log-probabilities
    of the same token: NEAR_TIE_REL[dtype] x the top logit of these random models, which sits
    about 4.5 `logit_std` up (the largest of ~1e5 normal draws)."""
    return NEAR_TIE_REL[dtype] * 4.5 * logit_std(cfg)


def compare_greedy(ref_tokens, ref_logprobs, got_tokens, tolerance: float,
                   got_logprobs=None) -> dict:
    """The near-tie rule of the CPU tests for one request: tokens identical up to the first
    divergence; there the reference's log-probability of its own token may exceed that of the
    other token by less than `tolerance` (a near-tie, after which nothing more is compared).
    `ref_logprobs[i]` is the reference's {token: logprob} (top-k) at step i. With
    `got_logprobs`, the log-probability of every token both agree on must also agree within
    `tolerance` (an attention bug too small to flip a token still moves it).
    Returns {"ok", "compared", "first_divergence", "gap", "near_tie", "max_logprob_diff"}."""
    n = min(len(ref_tokens), len(got_tokens))
    worst = 0.0
    for i in range(n):
        if ref_tokens[i] == got_tokens[i]:
            if got_logprobs is not None:
                worst = max(worst, abs(got_logprobs[i][got_tokens[i]]
                                       - ref_logprobs[i][ref_tokens[i]]))
                if worst >= tolerance:
                    return {"ok": False, "compared": i + 1, "first_divergence": None,
                            "gap": None, "near_tie": False, "max_logprob_diff": worst,
                            "logprob_mismatch_at": i}
            continue
        top = ref_logprobs[i] or {}
        other = top.get(got_tokens[i])          # None: not even in the reference's top-k
        gap = None if other is None else float(top[ref_tokens[i]] - other)
        near = gap is not None and gap < tolerance
        return {"ok": near, "compared": i + 1, "first_divergence": i, "gap": gap,
                "near_tie": near, "max_logprob_diff": worst, "reference": ref_tokens[i:i + 4],
                "got": got_tokens[i:i + 4]}
    return {"ok": len(ref_tokens) == len(got_tokens), "compared": n, "first_divergence": None,
            "gap": None, "near_tie": False, "max_logprob_diff": worst}


def simulated_failure(kind: str) -> bool:
    """GPU_CHECK_SIMULATE_FAILURE: "1"/"all" or a comma list of kernels, e2e, timeout."""
    value = os.environ.get("GPU_CHECK_SIMULATE_FAILURE", "")
    kinds = {k.strip() for k in value.split(",") if k.strip()}
    return bool(kinds & {kind, "all"}) or (value == "1" and kind == "kernels")


# ---- runs ---------------------------------------------------------------------------------------

def make_engine(loaded: LoadedModel, slots: int, max_model_len: int, backend: str, **kw):
    from jaxbatch.engine.llm_engine import LLMEngine
    pages = -(-max_model_len // 16)
    # num_blocks sized to the run (not half the GPU): two engines on an 8B model must coexist.
    return LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=max_model_len,
                     num_blocks=slots * pages + 1, attention_backend=backend, warmup=False, **kw)


def generate(engine, prompts, new_tokens: int, logprobs: int | None = None):
    """Runs prompts to completion; returns (token lists, logprob dicts per token or None,
    seconds, per-step (seconds, seqs, tokens))."""
    from jaxbatch import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=logprobs)
    ids = [f"r{i}" for i in range(len(prompts))]
    start, previous = time.perf_counter(), time.monotonic()     # step-log times are monotonic
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    first_step = len(engine.step_log)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    seconds = time.perf_counter() - start
    steps = []
    for when, seqs, _, tokens in engine.step_log[first_step:]:
        steps.append((when - previous, seqs, tokens))
        previous = when
    return ([list(outputs[rid].token_ids) for rid in ids],
            [outputs[rid].logprobs for rid in ids], seconds, steps)


def speed_run(loaded, slots, prompt_len, new_tokens, backend, seed, **engine_kw):
    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(slots)]
    engine = make_engine(loaded, slots, prompt_len + new_tokens, backend, **engine_kw)
    generate(engine, prompts, new_tokens)      # untimed: compiles every bucket the run uses
    compiled = engine.stats()["num_compilations"]
    tokens, _, seconds, steps = generate(engine, prompts, new_tokens)
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


def greedy_check(loaded, prompts, speed_tokens, backend, slots, max_model_len, check_tokens,
                 tolerance):
    """The timed run's greedy tokens against the reference backend's (near-tie rule), and a
    rerun of the checked prompts on the timed backend with log-probabilities, whose tokens and
    log-probabilities must agree with the reference's too."""
    runs = {}
    for name in ("reference", backend):
        engine = make_engine(loaded, slots, max_model_len, name)
        runs[name] = generate(engine, prompts, check_tokens, logprobs=CHECK_LOGPROBS)[:2]
        del engine
        gc.collect()
    ref_tokens, ref_logprobs = runs["reference"]
    got_tokens, got_logprobs = runs[backend]
    speed_tokens = [list(t[:check_tokens]) for t in speed_tokens]
    if simulated_failure("e2e") and speed_tokens and speed_tokens[0]:
        # A token the reference does not even rank in its top-k: never a near-tie.
        top = ref_logprobs[0][0] or {}
        speed_tokens[0][0] = next(t for t in range(loaded.config.vocab_size) if t not in top)
    requests = []
    for i, ref in enumerate(ref_tokens):
        timed = compare_greedy(ref, ref_logprobs[i], speed_tokens[i], tolerance)
        rerun = compare_greedy(ref, ref_logprobs[i], got_tokens[i], tolerance, got_logprobs[i])
        requests.append(dict(request=i, ok=timed["ok"] and rerun["ok"], timed=timed,
                             rerun=rerun, near_tie=timed["near_tie"] or rerun["near_tie"],
                             diverged=timed["first_divergence"] is not None
                             or rerun["first_divergence"] is not None))
    return {"requests": len(prompts), "tokens_each": check_tokens, "tolerance": tolerance,
            "equal": all(r["ok"] for r in requests),
            "exact": all(r["ok"] and not r["diverged"] for r in requests),
            "near_ties": sum(r["near_tie"] for r in requests),
            "max_logprob_diff": max((r["rerun"]["max_logprob_diff"] for r in requests),
                                    default=0.0),
            "mismatches": [r for r in requests if not r["ok"]],
            "divergences": [r for r in requests if r["diverged"]],
            "simulated_failure": simulated_failure("e2e")}


def run_model(name, args, backend):
    start = time.perf_counter()
    loaded = random_model(name, args.dtype, args.seed)
    result = {"model": name, "dtype": args.dtype, "config": dataclasses.asdict(MODEL_SHAPES[name]),
              "param_bytes": param_bytes(loaded.params), "init_seconds": loaded.load_seconds}
    speed, prompts, tokens = speed_run(loaded, args.slots, args.prompt_len, args.new_tokens,
                                       backend, args.seed)
    result["speed"] = speed
    n = min(args.check_requests, len(prompts))
    tolerance = args.near_tie if args.near_tie is not None else near_tie_tolerance(
        loaded.config, args.dtype)
    result["check"] = greedy_check(loaded, prompts[:n], tokens[:n], backend, args.slots,
                                   args.prompt_len + args.new_tokens, args.check_tokens,
                                   tolerance)
    if name in args.int8_models and time.perf_counter() - args.started > args.budget_s - 30:
        result["speed_int8"] = {"skipped": "time budget spent"}
    elif name in args.int8_models:
        # After the check (which decides pass/fail): the same run with an int8 KV cache and
        # int8 weights, timing only (accuracy is `python -m benchmarks accuracy`'s job); same prompts, so
        # the speeds compare directly.
        result["speed_int8"] = speed_run(loaded, args.slots, args.prompt_len, args.new_tokens,
                                         backend, args.seed, kv_cache_dtype="int8",
                                         quantization="int8")[0]
    result["seconds"] = time.perf_counter() - start
    del loaded
    gc.collect()
    return result


def model_ok(r) -> bool:
    return ("speed" in r and r["check"]["equal"] and r["speed"]["compilations_timed"] == 0)


# ---- report -------------------------------------------------------------------------------------

def table(results) -> str:
    lines = ["| model | backend | e2e tok/s | decode tok/s | decode step ms | compiles "
             "(warm-up / timed) | greedy vs reference |", "|---" * 7 + "|"]
    for r in results:
        if "error" in r or "skipped" in r:
            what = ("ERROR " + r["error"]) if "error" in r else ("SKIPPED " + r["skipped"])
            lines.append(f"| {r['model']} | {what[:100]} | | | | | |")
            continue
        s, c = r["speed"], r["check"]
        if not c["equal"]:
            eq = f"FAIL ({len(c['mismatches'])}/{c['requests']} differ beyond a near-tie)"
        else:
            eq = ("PASS" + (f", {c['near_ties']} near-tie(s)" if c["near_ties"] else ", identical")
                  + f", logprob diff {c['max_logprob_diff']:.2g}")
        lines.append(f"| {r['model']} {r['dtype']} | {s['backend']} | "
                     f"{s['e2e_output_tokens_per_s']:.0f} | {s['decode_tokens_per_s'] or 0:.0f} | "
                     f"{s['decode_step_ms_median'] or 0:.2f} | {s['compilations_warmup']} / "
                     f"{s['compilations_timed']} | {eq} ({c['requests']}x{c['tokens_each']}) |")
        q = r.get("speed_int8")
        if q and "skipped" in q:
            lines.append(f"| {r['model']} int8 KV + weights | SKIPPED {q['skipped']} | | | | | |")
        elif q:
            lines.append(f"| {r['model']} int8 KV + weights | {q['backend']} | "
                         f"{q['e2e_output_tokens_per_s']:.0f} | {q['decode_tokens_per_s'] or 0:.0f} | "
                         f"{q['decode_step_ms_median'] or 0:.2f} | {q['compilations_warmup']} / "
                         f"{q['compilations_timed']} | (timing only) |")
    return "\n".join(lines)


def summary_line(results) -> str:
    parts = []
    for r in results:
        if "speed" in r:
            parts.append(f"{r['model']} {r['speed']['decode_tokens_per_s'] or 0:.0f} decode tok/s "
                         f"({r['speed']['backend']}), "
                         f"check={'PASS' if r['check']['equal'] else 'FAIL'}"
                         + ("" if r["speed"]["compilations_timed"] == 0 else ", COMPILED IN TIMED RUN"))
        else:
            parts.append(f"{r['model']} " + ("ERROR" if "error" in r else "SKIPPED"))
    return "gpu_e2e: " + "; ".join(parts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shape, Pallas in interpret mode: checks this script only")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODEL_SHAPES),
                    help="default: small 1B 8B (tiny with --dry-run)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default bfloat16; float32 with --dry-run (its tolerance is tight "
                         "enough for the CPU run to catch a kernel bug, not just a crash)")
    ap.add_argument("--backend", default=None,
                    help="attention backend of the timed engine (default: auto; "
                         "pallas_interpret with --dry-run)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--near-tie", type=float, default=None,
                    help="top-2 log-probability gap (nats) under which greedy tokens may "
                         "differ; default near_tie_tolerance(model, dtype)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="no new model is started after this many seconds")
    ap.add_argument("--int8-models", nargs="*", default=None, choices=sorted(MODEL_SHAPES),
                    help="models also timed with kv_cache_dtype=int8 and quantization=int8 "
                         "(default: 8B, where decode is bandwidth-bound; tiny with --dry-run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.dry_run else "bfloat16")
    if args.dry_run:
        args.models = args.models or ["tiny"]
        args.slots, args.prompt_len = min(args.slots, 4), min(args.prompt_len, 32)
        args.new_tokens, args.check_requests = min(args.new_tokens, 8), min(args.check_requests, 2)
        args.check_tokens = min(args.check_tokens, args.new_tokens)
    args.models = args.models or ["small", "1B", "8B"]
    if args.int8_models is None:
        args.int8_models = ["tiny"] if args.dry_run else ["8B"]
    if args.check_tokens > args.new_tokens:
        ap.error("--check-tokens must be <= --new-tokens")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        print("gpu_e2e: no GPU (jax backend is %r); use --dry-run on CPU" % jax.default_backend())
        return 2
    from jaxbatch.worker.attention import resolve_backend
    backend = resolve_backend(args.backend or ("auto" if on_gpu else "pallas_interpret"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "attention_backend": backend, "jax": jax.__version__, "dry_run": args.dry_run,
              "args": vars(args), "models": []}
    if on_gpu:
        report["copy_GBps"] = copy_bandwidth(1 << 30) / 1e9
    start = args.started = time.perf_counter()
    for name in args.models:
        if time.perf_counter() - start > args.budget_s:
            report["models"].append({"model": name, "skipped": "time budget spent"})
            continue
        print(f"[gpu_e2e] {name}: random {args.dtype} weights, {args.slots} slots, "
              f"attention {backend}", flush=True)
        try:
            report["models"].append(run_model(name, args, backend))
        except Exception as e:        # keep going: one model's failure must not hide the others
            report["models"].append({"model": name, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
        (out_dir / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = time.perf_counter() - start
    models = report["models"]
    report["status"] = ("fail" if any("error" in r or ("speed" in r and not model_ok(r))
                                      for r in models)
                        else "incomplete" if any("skipped" in r for r in models) else "pass")
    (out_dir / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(models))
    print(summary_line(models))
    return {"pass": 0, "fail": 1, "incomplete": 3}[report["status"]]


if __name__ == "__main__":
    sys.exit(main())
