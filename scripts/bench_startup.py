"""Start-up cost of the embedded model: `LLM()` to first token, cold and from the caches.

    python scripts/bench_startup.py [--max-num-seqs 16] [--max-model-len 8192] [--out bench_out]

Each measurement is a fresh Python process (what a user's second start is), in a private cache
root that holds the converted weights but, depending on the mode, no compiled code:
  cold         nothing compiled on disk: every bucket is traced, lowered and compiled
  warm         JAX's persistent compilation cache filled by the cold start: traced and
               lowered, then read from disk instead of compiled
plus `serial`: the cold compile on one thread, for the per-executable compile time. Reports
load, warm-up (lower / compile split), executables, and time to the first token.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import jax
from jaxbatch import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
workers = kwargs.pop("warmup_workers", None)
llm = LLM(warmup=False, **kwargs)
engine = llm.llm_engine
ready_load = time.perf_counter()
engine.runner.warmup(max_workers=workers)
ready = time.perf_counter()
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
first = time.perf_counter()
stats = engine.stats()
print("RESULT " + json.dumps({
    "import_and_load_s": ready_load - start, "load_s": engine.load_seconds,
    "warmup_s": ready - ready_load, "llm_to_first_token_s": first - start,
    "first_request_s": first - ready, "warmup": engine.runner.warmup_report,
    "compilations_after_warmup": stats["num_compilations_after_warmup"]}))
"""


def run_child(cache_root: str, kwargs: dict) -> dict:
    env = dict(os.environ, JAXBATCH_CACHE=cache_root, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--skip-serial", action="store_true", help="skip the one-thread cold compile")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    kwargs = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len

    from jaxbatch.model.loader import cache_root, load_model
    load_model(dtype="float32")                      # converted weights in the user cache
    weights = [p for p in Path(cache_root()).iterdir()
               if p.is_dir() and p.name != "xla"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in weights:                            # weights only: no compiled code yet
            shutil.copytree(p, Path(tmp) / p.name)
        modes = [] if args.skip_serial else [("serial", {"warmup_workers": 1})]
        modes += [("cold", {}), ("warm", {})]
        for mode, extra in modes:
            if mode in ("serial", "cold"):
                shutil.rmtree(Path(tmp) / "xla", ignore_errors=True)
            print(f"[bench_startup] {mode} ...", flush=True)
            results[mode] = run_child(tmp, {**kwargs, **extra})
    lines = ["| start | LLM() to first token s | load s | warm-up s | executables | "
             "lower s | compile s | per executable s |", "|---" * 8 + "|"]
    for mode, r in results.items():
        w = r["warmup"]
        # Per executable: lowering plus compile time on one core (exact for `serial`).
        per = (w["lower_s"] + w["compile_s"] * w["threads"]) / max(1, w["compiled"])
        lines.append(f"| {mode} | {r['llm_to_first_token_s']:.1f} | {r['load_s']:.1f} | "
                     f"{r['warmup_s']:.1f} | {w['executables']} | {w['lower_s']:.1f} | "
                     f"{w['compile_s']:.1f} | {per:.2f} |")
    table = "\n".join(lines)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "startup.json").write_text(json.dumps(
        {"settings": kwargs, "cpu_count": os.cpu_count(), "results": results}, indent=1))
    print(table)
    return results


if __name__ == "__main__":
    main()
