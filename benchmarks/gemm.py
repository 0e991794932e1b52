"""Our CPU GEMM kernel (`cpu_kernels/packed_gemm.cc`) against the XLA dot it replaces, on the
embedded model's matrices, at the row counts the engine calls them with.

    python -m benchmarks gemm [--rows 1 4 16 64 256] [--dtype bfloat16 float32]
                                  [--matrices wqkv wo ...] [--calls 30] [--out bench_out/gemm]

Both run on the same random x and weight, in their own storage forms: XLA's dot over the
transposed [out, in] weight (`precision.to_storage`'s form, which XLA:CPU's fully-connected
kernels read in place) and the kernel over the packed weight. Calls alternate, XLA then
kernel, each jitted and waited for; the medians, GFLOP/s and their ratio are reported, with
the largest difference relative to the largest output.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from jaxbatch.benchmarks.report import table, write_report

# (name, in, out) of SmolLM2-135M's matrices as the engine stores them (fused on CPU)
SHAPES = [("wqkv", 576, 960), ("wo", 576, 576), ("w_gate_up", 576, 3072),
          ("w_down", 1536, 576), ("lm_head", 576, 49152)]


def measure(dtype: str, rows: int, fan_in: int, fan_out: int, calls: int, rng) -> dict:
    import jax
    import jax.numpy as jnp

    from cpu_kernels import packed_gemm
    dt = jnp.dtype(dtype)
    w = rng.standard_normal((fan_in, fan_out)).astype(np.float32).astype(dt)
    x = jnp.asarray(rng.standard_normal((rows, fan_in)).astype(np.float32)).astype(dt)
    w_t, w_packed = jnp.asarray(np.ascontiguousarray(w.T)), jnp.asarray(packed_gemm.pack(w))
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    kernel = jax.jit(packed_gemm.matmul)
    want, got = xla(x, w_t).block_until_ready(), kernel(x, w_packed).block_until_ready()
    times = {"xla": [], "kernel": []}
    for _ in range(calls):
        for name, fn, weight in (("xla", xla, w_t), ("kernel", kernel, w_packed)):
            start = time.perf_counter()
            fn(x, weight).block_until_ready()
            times[name].append(time.perf_counter() - start)
    flops = 2 * rows * fan_in * fan_out
    xla_ms, kernel_ms = (1e3 * float(np.median(times[k])) for k in ("xla", "kernel"))
    return {"xla_ms": xla_ms, "kernel_ms": kernel_ms, "speedup": xla_ms / kernel_ms,
            "xla_gflops": flops / xla_ms / 1e6, "kernel_gflops": flops / kernel_ms / 1e6,
            "max_rel_diff": float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--matrices", nargs="+", default=[name for name, _, _ in SHAPES],
                    choices=[name for name, _, _ in SHAPES])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default="bench_out/gemm")
    args = ap.parse_args(argv)
    from cpu_kernels import packed_gemm
    reason = packed_gemm.unavailable_reason()
    if reason:
        print(f"the kernel cannot run here: {reason}")
        return 1
    rng = np.random.default_rng(0)
    results, rows = [], []
    for dtype in args.dtype:
        for name, fan_in, fan_out in (s for s in SHAPES if s[0] in args.matrices):
            for m in args.rows:
                r = {"dtype": dtype, "matrix": name, "in": fan_in, "out": fan_out, "rows": m,
                     **measure(dtype, m, fan_in, fan_out, args.calls, rng)}
                results.append(r)
                rows.append([dtype, f"{name} [{fan_in}, {fan_out}]", m, f"{r['xla_ms']:.3f}",
                             f"{r['kernel_ms']:.3f}", f"{r['xla_gflops']:.0f}",
                             f"{r['kernel_gflops']:.0f}", f"{r['speedup']:.2f}",
                             f"{r['max_rel_diff']:.1e}"])
                print(" | ".join(map(str, rows[-1])), flush=True)
    md = table(["dtype", "matrix", "rows", "XLA ms", "kernel ms", "XLA GFLOP/s",
                "kernel GFLOP/s", "XLA / kernel", "max rel diff"], rows)
    print(md)
    write_report(args.out, "gemm", {"results": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
