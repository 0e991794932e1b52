"""Step time of chosen executable keys on the embedded model, for pricing a bucket change.

    python -m benchmarks step-keys "prefill,16,1" "prefill,16,4" "decode,32,64" [--reps 20]

Each key (decode rows,items | prefill tokens,pages | sample rows) is compiled directly, whether
or not the bucket rules list it, and run on warm-up's placeholder inputs with every row made
real (each writes into slot 1 of the null block, so the GEMMs compute every row: the
arithmetic of a real call of that shape, except attention on the xla backend, whose loop
over the context in use runs no iteration there), the keys taking turns so that a shared
machine's load drifts over all of them alike. Reports min and median wall and process CPU
milliseconds. Keys are listed by `runner.bucket_shapes()`; for xla, ("decode", rows, items)
and ("prefill", tokens, pages) with the items and pages it lists.

It runs compiled executables on the runner's argument layout, so it needs the runner to offer
that layout publicly: `runner.model_args(key, call_args)` and `runner.sampling_arrays(rows)`.
Until the runner has them this tool says so and stops (it used to call their private forms).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks step-keys",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="+", help="kind,a[,b], e.g. decode,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args(argv)
    import jax
    import numpy as np
    from jaxbatch import LLM
    from jaxbatch.worker.runner import ModelRunner
    missing = [name for name in ("model_args", "sampling_arrays") if not hasattr(ModelRunner, name)]
    if missing:          # said before a model loads
        raise SystemExit(f"step-keys needs the runner's public {', '.join(missing)} "
                         "(the executables' argument layout); this runner has none")
    runner = LLM(warmup=False, max_num_seqs=args.max_num_seqs,
                 compilation_cache=False).llm_engine.runner
    keys = [(k.split(",")[0],) + tuple(int(x) for x in k.split(",")[1:]) for k in args.keys]
    exes = {k: runner.executables.lower(k, runner.example_args(k)).compile() for k in keys}

    def run_once(key):
        if key[0] == "sample":
            # The sampler's arguments as the runner passes them (logits, sampling arrays, the
            # kept tokens it updates, the rows' token slots); its last output is the new kept.
            n = key[1]
            logits = jax.numpy.zeros((n, runner.model_cfg.vocab_size))
            out = jax.block_until_ready(exes[key](logits, runner.sampling_arrays([None] * n),
                                                  runner.kept_tokens, np.zeros(n, np.int32)))
            runner.kept_tokens = out[-1]
            return out
        args = runner.layout.placeholder_call(*key).args
        out = exes[key](*runner.model_args(key, every_row_real(key, args)))
        jax.block_until_ready(out)
        runner.pool = out[-1]

    times = {k: ([], []) for k in keys}
    for i in range(args.reps + 1):                    # the first round is untimed
        for key in keys if i % 2 else keys[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            run_once(key)
            if i:
                times[key][0].append(time.perf_counter() - wall)
                times[key][1].append(time.process_time() - cpu)
    report = {}
    for key in keys:
        walls, cpus = times[key]
        report[",".join(map(str, key))] = {
            "min_ms": 1e3 * min(walls), "median_ms": 1e3 * statistics.median(walls),
            "cpu_median_ms": 1e3 * statistics.median(cpus)}
        print(f"{key}: " + "  ".join(f"{n} {v:.1f}" for n, v in
                                     report[",".join(map(str, key))].items()))
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def every_row_real(key: tuple, args: tuple) -> tuple:
    """A placeholder call's args with no padding: a call's padding is the rows past its last
    one writing outside the null block's slot 0 (`decoder.padding_start`), and the GEMMs leave
    those out."""
    import numpy as np
    args = list(args)
    # the slot mapping: decode (tokens, token_src, positions, slot_mapping, meta), prefill
    # (tokens, positions, slot_mapping, meta, sample_index), mixed: decode's then prefill's
    at = {"decode": [3], "prefill": [2], "mixed": [3, 7]}[key[0]]
    for i in at:
        args[i] = np.ones_like(args[i])
    return tuple(args)


if __name__ == "__main__":
    main()


_every_row_real = every_row_real      # the name tests/worker/test_step_inputs.py imports
