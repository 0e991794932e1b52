"""Start-up cost of the embedded model: `LLM()` to first token, each start a fresh process in a
private cache root holding the converted weights: cold (nothing compiled on disk), warm (what
cold left: stored lowerings, JAX's cache), traced (--traced: JAX's cache only) and serial (cold
on one thread). Reports load, warm-up (wall and CPU s, lower / compile split), executables,
time to first token and the load average at the end."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxbatch.benchmarks.base import Benchmark, add_flags
from jaxbatch.benchmarks.report import fmt, table

# The directory holding the jaxbatch package: the children import this very copy of it.
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
start, cpu_start = time.perf_counter(), time.process_time()
import jax
from jaxbatch import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
workers = kwargs.pop("warmup_workers", None)
llm = LLM(warmup=False, **kwargs)
engine = llm.llm_engine
ready_load, cpu_load = time.perf_counter(), time.process_time()
engine.runner.warmup(max_workers=workers, run=engine.options.runtime.warmup_runs)
ready, cpu_ready = time.perf_counter(), time.process_time()
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
first = time.perf_counter()
stats = engine.stats()
print("RESULT " + json.dumps({
    "import_and_load_s": ready_load - start, "load_s": engine.load_seconds,
    "warmup_s": ready - ready_load, "warmup_cpu_s": cpu_ready - cpu_load,
    "cpu_to_first_token_s": time.process_time() - cpu_start, "loadavg": os.getloadavg(),
    "llm_to_first_token_s": first - start,
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


class Startup(Benchmark):
    name = "startup"

    def add_arguments(self, ap) -> None:
        add_flags(ap, max_num_seqs=16, repeats=(1, "cold and warm starts each this many times "
                                                   "(timings on a shared machine are noisy; CPU "
                                                   "seconds are reported beside wall time)"))
        ap.add_argument("--max-model-len", type=int, default=None)
        ap.add_argument("--skip-serial", action="store_true", help="skip the one-thread cold compile")
        ap.add_argument("--traced", action="store_true",
                        help="also start from JAX's cache without the stored lowerings")
        ap.add_argument("--unified-step", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine option (off: no mixed decode + prefill executables)")

    def bench(self, loaded, args) -> dict:
        """`loaded` converted the weights into the user cache; each start copies them."""
        from jaxbatch.model.loader import cache_root
        kwargs = {"max_num_seqs": args.max_num_seqs, "unified_step": args.unified_step,
                  **({"max_model_len": args.max_model_len} if args.max_model_len else {})}
        weights = [p for p in Path(cache_root()).iterdir()
                   if p.is_dir() and p.name not in ("xla", "lowered")]
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for p in weights:                            # weights only: no compiled code yet
                shutil.copytree(p, Path(tmp) / p.name)
            modes = [] if args.skip_serial else ["serial"]
            for i in range(args.repeats):
                tag = "" if args.repeats == 1 else f" {i + 1}"
                modes += [m + tag for m in ("cold", "warm") + (("traced",) if args.traced else ())]
            for mode in modes:
                if mode.startswith(("serial", "cold")):
                    shutil.rmtree(Path(tmp) / "xla", ignore_errors=True)
                if mode.startswith(("serial", "cold", "traced")):
                    shutil.rmtree(Path(tmp) / "lowered", ignore_errors=True)
                print(f"[bench_startup] {mode} ...", flush=True)
                workers = {"warmup_workers": 1} if mode == "serial" else {}
                results[mode] = run_child(tmp, {**kwargs, **workers})
        return {"settings": kwargs, "results": results}

    def markdown(self, report) -> str:
        rows = []
        for mode, r in report["results"].items():
            w = r["warmup"]
            # Per executable: CPU seconds of the warm-up (lowering, compiling and the first
            # runs of `warmup_runs`, every thread).
            per = r["warmup_cpu_s"] / max(1, w["compiled"])
            rows.append([mode, fmt(r["llm_to_first_token_s"]), fmt(r["load_s"]), fmt(r["warmup_s"]),
                         fmt(r["warmup_cpu_s"]), w["executables"], w.get("from_store", 0),
                         fmt(w["lower_s"]), fmt(w["compile_s"]), fmt(w["run_s"]), fmt(per, 2),
                         fmt(r["loadavg"][0])])
        return table(["start", "LLM() to first token s", "load s", "warm-up s", "warm-up CPU s",
                      "executables", "from store", "lower s", "compile s", "first runs s",
                      "CPU s per executable", "load average"], rows)


main = Startup().main
