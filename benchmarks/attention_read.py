"""Decode attention alone against the read bandwidth measured in the same run: the CPU kernel
(`cpu_kernels.paged_decode`, on AVX512-BF16 and, where the CPU has them, on AMX tiles) over
every layer's KV of a decode step, its pages in two orders:

    contiguous  each row's pages one after another, row after row, layer after layer (a fresh
                engine's pool)
    scattered   the same pages in a random order (a pool after long serving)

A decode step's attention reads each row's keys and values once and writes little, so its
floor is KV bytes / the read probe's rate (`roofline.read_bandwidth`). One timed call runs
`--layers` kernel calls in a jitted scan, each over its own layer's pages: nothing comes from
cache that a step would read from memory. Both orders are timed round by round, interleaved,
so a slow moment of the machine hits both alike (and both kernels: each order and kernel once a
round). Row lengths lie in (ctx/2, ctx]. Shapes default to SmolLM2-135M's (9 query heads over 3
KV heads of 64, 30 layers).

    python -m benchmarks attention-read [--rows 16 64] [--context 256] [--block-size 16]
        [--kernels avx512 amx]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.machine import machine_info
from jaxbatch.benchmarks.report import table, write_report

ORDERS = ("contiguous", "scattered")
KERNELS = ("avx512", "amx")         # the kernel's q.K and p.V: vdpbf16ps, or AMX tiles


def page_table(order: str, layers: int, rows: int, pages_per_row: int, seed: int = 0):
    """Page ids [layers, rows, pages_per_row]: every id of the pool's first
    layers * rows * pages_per_row once, in `order`."""
    if order not in ORDERS:
        raise ValueError(f"page order {order!r}: one of {ORDERS}")
    total = layers * rows * pages_per_row
    ids = np.arange(total)
    if order == "scattered":
        ids = np.random.default_rng(seed).permutation(total)
    return ids.reshape(layers, rows, pages_per_row).astype(np.int32)


def kv_bytes(lengths, layers: int, kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """Key and value bytes one step's attention reads over every layer."""
    return int(np.sum(lengths)) * layers * 2 * kv_heads * head_dim * itemsize


def attention_step(rows: int, ctx: int, block: int, layers: int, heads: int, kv_heads: int,
                   head_dim: int, seed: int = 0, kernels=("avx512",)):
    """(lengths, {(order, kernel): a function that runs one step's attention over every
    layer})."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels import paged_decode
    pages_per_row = ctx // block
    num_pages = layers * rows * pages_per_row
    rng = np.random.default_rng(seed)
    lengths = jnp.asarray(rng.integers(ctx // 2 + 1, ctx + 1, rows), jnp.int32)
    keys = jax.random.split(jax.random.key(seed), 3)
    bits = lambda key: jax.lax.bitcast_convert_type(      # bf16 values as the pool stores them
        jax.random.normal(key, (kv_heads, num_pages, block, head_dim), jnp.bfloat16), jnp.uint16)
    k_pages, v_pages = bits(keys[0]), bits(keys[1])
    q = jax.random.normal(keys[2], (layers, rows, heads, head_dim), jnp.bfloat16)
    item_slot = jnp.arange(rows, dtype=jnp.int32)        # one work item per row: all its pages
    first_pos = jnp.zeros(rows, jnp.int32)

    def step(amx, q, k_pages, v_pages, tables):
        def layer(total, xs):
            q_layer, pages = xs                          # [rows, H, D], [rows, pages_per_row]
            out = paged_decode.paged_decode_attention(q_layer, k_pages, v_pages, item_slot,
                                                      pages, first_pos, lengths, amx=amx)
            return total + out[:, 0, 0].astype(jnp.float32).sum(), None
        return jax.lax.scan(layer, jnp.float32(0), (q, tables))[0]

    steps = {kernel: jax.jit(functools.partial(step, kernel == "amx")) for kernel in kernels}
    runs = {}
    for order in ORDERS:
        tables = jnp.asarray(page_table(order, layers, rows, pages_per_row, seed))
        for kernel, run in steps.items():
            runs[order, kernel] = (lambda t=tables, run=run:
                                   jax.block_until_ready(run(q, k_pages, v_pages, t)))
            runs[order, kernel]()                        # compiled, pages touched
    return np.asarray(lengths), runs


def measure(rows: int, ctx: int, block: int, layers: int, heads: int, kv_heads: int,
            head_dim: int, reps: int, read_rate: float, kernels=("avx512",)) -> list[dict]:
    lengths, runs = attention_step(rows, ctx, block, layers, heads, kv_heads, head_dim,
                                   kernels=kernels)
    times = {order: [] for order in runs}
    for _ in range(reps):
        for order, run in runs.items():
            start = time.perf_counter()
            run()
            times[order].append(time.perf_counter() - start)
    nbytes = kv_bytes(lengths, layers, kv_heads, head_dim)
    results = []
    for (order, kernel), seconds in times.items():
        step = statistics.median(seconds)
        results.append({"rows": rows, "context": ctx, "block_size": block, "order": order,
                        "kernel": kernel,
                        "kv_mb": nbytes / 1e6, "ms": 1e3 * step, "gb_s": nbytes / step / 1e9,
                        "floor_ms": 1e3 * nbytes / read_rate,
                        "over_floor": step * read_rate / nbytes})
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    add_flags(ap, context=256, block_size=16, layers=30, heads=9, kv_heads=3, head_dim=64)
    ap.add_argument("--reps", type=int, default=15, help="timed rounds (each order once)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                    help="the kernel's arithmetic (amx: where the CPU has AMX and the shapes "
                         "fit its tiles)")
    ap.add_argument("--out", default="bench_out/attention_read")
    args = ap.parse_args(argv)
    if args.context % args.block_size or args.context < 2 or args.reps < 1:
        ap.error("--context: a multiple of --block-size, at least 2; --reps at least 1")
    from cpu_kernels import paged_decode
    from jaxbatch.benchmarks.roofline import read_bandwidth
    reason = paged_decode.why_not("uint16", args.heads, args.kv_heads, args.head_dim)
    if reason:
        print(f"attention-read: the CPU decode kernel does not run here: {reason}")
        return 1
    kernels = list(args.kernels)
    if "amx" in kernels:
        reason = paged_decode.amx_why_not("uint16", args.block_size, args.head_dim)
        if reason:
            print(f"attention-read: no AMX variant here: {reason}")
            kernels.remove("amx")
    if not kernels:
        return 1
    read_rate = read_bandwidth()
    print(f"read bandwidth {read_rate / 1e9:.1f} GB/s", flush=True)
    results = [r for rows in args.rows
               for r in measure(rows, args.context, args.block_size, args.layers, args.heads,
                                args.kv_heads, args.head_dim, args.reps, read_rate, kernels)]
    md = "\n\n".join([
        f"read bandwidth {read_rate / 1e9:.1f} GB/s; {args.layers} layers, {args.heads} heads "
        f"over {args.kv_heads} KV heads of {args.head_dim}, bf16 pages of {args.block_size}",
        table(["rows", "context", "pages", "kernel", "KV MB", "ms per step", "GB/s", "floor ms",
               "step / floor"],
              [[r["rows"], r["context"], r["order"], r["kernel"], f"{r['kv_mb']:.0f}",
                f"{r['ms']:.2f}",
                f"{r['gb_s']:.1f}", f"{r['floor_ms']:.2f}", f"{r['over_floor']:.2f}"]
               for r in results])])
    print(md)
    report = {"machine": machine_info(), "args": vars(args), "read_bandwidth_bytes_s": read_rate,
              "results": results}
    for path in write_report(args.out, "attention_read", report, md):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
