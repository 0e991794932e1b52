"""jaxbatch against vLLM's CPU build, offline `LLM.generate`, side by side in one run: the same 48
chat requests (the serve benchmark's workload: bundled prompts, chat template, output lengths
lognormal(32, 1) in [8, 256]), 16 slots, greedy, ignore_eos; each engine (and dtype: float32 by
default, `--jaxbatch-dtypes` / `--vllm-dtypes` for more) in its own process, one untimed pass
then --passes timed ones; the engines take turns --rounds times (the order rotating each round),
so a slow moment of this shared machine hits all alike. Prefix caching is set alike on both sides:
`off`, or `on` with the cache reset before every pass (the workload repeats prompts, so a pass
would otherwise find the previous pass's prompts cached: a measure of the cache, not the engine)
and jaxbatch's `prefix_cache_granularity="block"` (vLLM's: its 25 distinct prompts are shorter
than one of jaxbatch's 256-token prefill chunks, so the default "chunk" rule would share none).

    python -m benchmarks vs-vllm [--prefix-caching off on] [--rounds 2] [--omp-bind 0-1]
        [--jaxbatch-dtypes bfloat16 float32 w8a8] [--vllm-dtypes bfloat16 float32] [--hf-dtypes float32]
        [--model HF_DIR]

`w8a8` among the jaxbatch dtypes: bf16 activations, quantization="w8a8". `--model` gives both
engines one checkpoint (`python -m benchmarks random-checkpoint` writes one of a real shape);
without it jaxbatch runs the embedded model and vLLM its export (--vllm-model).

Needs the vLLM venv (scripts/setup_vllm_cpu.sh) and the exported model
(scripts/export_safetensors.py). vLLM's CPU backend by default computes on one core and keeps
the other for its front end; --omp-bind 0-1 gives it both (jaxbatch's XLA uses every core).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from jaxbatch.benchmarks.machine import add_price_argument, machine_info, resolve_price
from jaxbatch.benchmarks.report import cost_cell, price_line, table, write_json
from benchmarks.serve_launch import DEFAULT_VLLM_PYTHON, REPO
from jaxbatch.benchmarks.workloads import make_workload


def run_jaxbatch(args, caching: str, out_dir: Path, dtype: str) -> float:
    workload = make_workload(48)
    quantization = "w8a8" if dtype == "w8a8" else None
    spec = {"llm_kwargs": {"max_num_seqs": 16, "max_model_len": 2048,
                           "dtype": "bfloat16" if quantization else dtype,
                           "quantization": quantization, "model": args.model,
                           "enable_prefix_caching": caching == "on",
                           # vLLM caches in whole blocks: the like-for-like setting
                           "prefix_cache_granularity": "block",
                           "async_scheduling": not args.no_async_scheduling},
            "texts": [r.text for r in workload], "max_tokens": [r.max_tokens for r in workload],
            "timed_passes": args.passes, "out": str(out_dir / f"jaxbatch_{dtype}_{caching}.json")}
    spec_path = out_dir / f"jaxbatch_spec_{dtype}_{caching}.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, "-m", "benchmarks.serve_launch", "--offline-worker",
                    str(spec_path)], check=True, cwd=REPO)
    return json.loads(Path(spec["out"]).read_text())["output_tokens_per_s"]


def run_vllm(args, caching: str, out_dir: Path, dtype: str) -> float:
    out = out_dir / f"vllm_{dtype}_{caching}.json"
    cmd = [str(DEFAULT_VLLM_PYTHON), "-m", "benchmarks.vllm_offline",
           "--model", args.vllm_model, "--passes", str(args.passes), "--out", str(out),
           "--dtype", dtype,
           "--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching"]
    if args.omp_bind:
        cmd += ["--omp-bind", args.omp_bind, "--reserved-cpus", "0"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tokens_per_s"]


def run_hf(args, caching: str, out_dir: Path, dtype: str) -> float:
    """HF `generate` (static groups of 16) on the same workload (caching is always off)."""
    out = out_dir / f"hf_{dtype}.json"
    subprocess.run([sys.executable, "-m", "benchmarks.hf_offline", "--model",
                    args.vllm_model, "--dtype", dtype, "--out", str(out)],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tokens_per_s"]


RUNNERS = {"jaxbatch": run_jaxbatch, "vllm": run_vllm, "hf": run_hf}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vs-vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-caching", nargs="+", choices=("off", "on"), default=["off", "on"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--vllm-model", default=str(REPO / "hf_export/SmolLM2-135M-Instruct"))
    ap.add_argument("--model", default=None,
                    help="one HF directory for every engine (default: the embedded model)")
    ap.add_argument("--omp-bind", default=None)
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--jaxbatch-dtypes", nargs="+", default=["float32"],
                    choices=("float32", "bfloat16", "auto", "w8a8"))
    ap.add_argument("--vllm-dtypes", nargs="+", default=["float32"],
                    choices=("float32", "bfloat16"))
    ap.add_argument("--hf-dtypes", nargs="*", default=[], choices=("float32", "bfloat16"),
                    help="also HF transformers `generate` (static groups of 16) in these dtypes")
    ap.add_argument("--out", default="bench_out/vs_vllm")
    add_price_argument(ap)
    args = ap.parse_args(argv)
    if args.model:
        args.vllm_model = args.model
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"argv": sys.argv, "machine": machine_info(with_jax=False), "results": {}}
    # Both engines run on this machine: one price for both.
    report["price"] = price = resolve_price(args.price_per_hour, report["machine"])
    for caching in args.prefix_caching:
        # HF generate has no prefix cache: it runs with caching off only.
        engines = ([("jaxbatch", d) for d in args.jaxbatch_dtypes]
                   + [("vllm", d) for d in args.vllm_dtypes]
                   + [("hf", d) for d in args.hf_dtypes if caching == "off"])
        runs = {f"{e} {d}": [] for e, d in engines}
        for r in range(args.rounds):
            k = r % len(engines)
            for engine, dtype in engines[k:] + engines[:k]:       # the order rotates
                run = RUNNERS[engine]
                name = f"{engine} {dtype}"
                runs[name].append(run(args, caching, out_dir, dtype))
                print(f"prefix caching {caching}, round {r}: {name} "
                      f"{runs[name][-1]:.1f} out tok/s", flush=True)
        med = {name: statistics.median(v) for name, v in runs.items()}
        best = {e: max(v for name, v in med.items() if name.startswith(e + " "))
                for e in ("jaxbatch", "vllm")}
        report["results"][caching] = {"runs": runs, "median": med, "best": best,
                                      "ratio_of_bests": best["jaxbatch"] / best["vllm"]}
        if "jaxbatch float32" in med and "hf float32" in med:
            report["results"][caching]["float32_over_hf"] = (med["jaxbatch float32"]
                                                             / med["hf float32"])
    write_json(out_dir / "vs_vllm.json", report)
    rows = []
    for caching, res in report["results"].items():
        for name, v in res["median"].items():
            rows.append([caching, name, " / ".join(f"{x:.1f}" for x in res["runs"][name]),
                         f"{v:.1f}", f"{v / res['best']['vllm']:.2f}", cost_cell(v, price)])
    print(table(["prefix caching", "engine", "out tok/s per round", "median",
                 "/ vLLM's best", "$ / M out tok"], rows))
    for caching, res in report["results"].items():
        print(f"prefix caching {caching}: jaxbatch's best / vLLM's best = "
              f"{res['ratio_of_bests']:.2f}")
        if "float32_over_hf" in res:
            print(f"prefix caching {caching}: jaxbatch float32 / HF generate float32 = "
                  f"{res['float32_over_hf']:.2f}")
    print(price_line(price))
    return report


if __name__ == "__main__":
    main()
