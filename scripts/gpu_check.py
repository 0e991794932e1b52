"""Worker of scripts/gpu_check.sh: kernel correctness and speed on the GPU, then the report.

  python scripts/gpu_check.py kernels --out DIR [--dry-run] [--budget-s S]  -> DIR/kernels.json
  python scripts/gpu_check.py report  --out DIR      -> DIR/results.json, the table; exit status

`kernels`, in this order, each section saved to kernels.json as soon as it ends (a timeout keeps
what was done):
  availability    whether this jax imports and lowers the Pallas Triton kernels, and what the
                  engine's `auto` attention backend picks here (pallas, or the xla fallback)
  correctness     REQUIRED. Each GPU attention path against its plain-jnp reference on fresh
                  random inputs (bf16 and f32, Llama-8B and SmolLM2 head shapes, NaN in every
                  pool slot that must not be read, an empty slot, padding tokens): the Pallas
                  decode and ragged kernels (when this jax has them), the xla path (`auto`'s
                  fallback, plain jnp), and the KV write. Relative error f32 < 1e-5, bf16 < 1e-2.
  copy_bandwidth  of this device, measured in the same run
  decode_headline the decode kernel at B=64 / context 4096 / 32 query and 8 KV heads /
                  head_dim 128 / bf16 (a small sweep of tile, split and warp settings) next to
                  JAX's shipped `pallas.ops.gpu.paged_attention` on the same inputs
  ragged, kv_write the ragged kernel on decode, prefill and mixed batches; the KV write
  int8_decode, int8_weights  int8 vs bf16: the decode kernel on an int8 KV pool vs a bf16 one
                  at the headline shape, and Llama-8B MLP matmuls with int8 vs bf16 weights
                  (scripts/gpu_check_int8.py; the int8 KV kernels' correctness cases are rows
                  of `correctness`)
The timing sections are optional: once `--budget-s` is spent, the remaining sweep points and
sections are skipped (recorded as such), so the section's hard time limit in gpu_check.sh is
never reached in a healthy run. `--dry-run` (or DRY_RUN=1) runs all of it on CPU with tiny
shapes and interpret mode, to check the script itself. Timings are device-synchronised wall
time (median of reps).

`report` merges kernels.json, gpu_e2e.json and the exit codes gpu_check.sh recorded
(kernels.rc, e2e.rc) into results.json, prints the markdown table LAST (its last row is the
verdict) and exits 0 only when every correctness check passed and every section finished in
time; 1 on any failure, timeout or crash; 3 when nothing failed but something was skipped
(an end-to-end model for lack of time).

One GPU, so no tensor or data parallelism is checked here; what a multi-GPU run would add is
listed in gpu_check.sh's header and docs/PARALLELISM.md.

GPU_CHECK_SIMULATE_FAILURE (comma list; "1" = kernels): `kernels` corrupts one kernel output in
the correctness section, `timeout` makes the kernels section hang after the correctness
section (the shell's limit must kill it, and the end-to-end section must still run), `e2e`
corrupts one checked token in gpu_e2e. Each must make gpu_check.sh exit non-zero;
tests/benchmarks/test_gpu_check.py checks that on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

# gpu_check_int8 lies beside this script (Python puts a script's directory first on sys.path);
# jaxbatch and pallas_kernels come from the install or from PYTHONPATH (gpu_check.sh sets it
# to the repository).
import gpu_check_int8  # noqa: E402

DEFAULT_BUDGET_S = 110    # the kernels part starts no new timing work after this
HEADLINE = dict(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                block_size=16)
TARGET_COPY_FRACTION, TARGET_SPEEDUP = 0.85, 1.2
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
TIMEOUT_CODES = ("124", "137")


def simulated_failure(kind: str) -> bool:
    """GPU_CHECK_SIMULATE_FAILURE: "1"/"all" or a comma list of kernels, e2e, timeout (the same
    parsing as gpu_e2e.simulated_failure; kept here so this script does not need the
    jaxbatch package to check the kernels)."""
    value = os.environ.get("GPU_CHECK_SIMULATE_FAILURE", "")
    kinds = {k.strip() for k in value.split(",") if k.strip()}
    return bool(kinds & {kind, "all"}) or (value == "1" and kind == "kernels")


# --- inputs ------------------------------------------------------------------------------------

def poisoned_pool(rng, lengths, num_kv_heads, block_size, head_dim, pages_per_seq, spare=4):
    """Pool [KVH, N, bs, D] with random values only in the first lengths[i] slots of each
    sequence's pages (randomly permuted); NaN everywhere else, null block 0 included."""
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = 1 + sum(needed) + spare
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), pages_per_seq), np.int32)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k, v = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    for i, n in enumerate(lengths):
        tables[i, :needed[i]] = [free.pop() for _ in range(needed[i])]
        pos = np.arange(n)
        blocks, offs = tables[i][pos // block_size], pos % block_size
        k[:, blocks, offs] = rng.standard_normal((num_kv_heads, n, head_dim))
        v[:, blocks, offs] = rng.standard_normal((num_kv_heads, n, head_dim))
    unused = (tables == 0) & (rng.random(tables.shape) < 0.5)
    tables[unused] = rng.choice(np.asarray(free), unused.sum())      # spare NaN pages
    return k, v, tables


def decode_inputs(rng, jnp, dtype, batch, num_heads, num_kv_heads, head_dim, block_size,
                  pages_per_seq):
    context = pages_per_seq * block_size
    lengths = rng.integers(1, context + 1, batch)
    lengths[0], lengths[-1] = 0, context                     # an empty slot and a full table
    k, v, tables = poisoned_pool(rng, lengths, num_kv_heads, block_size, head_dim,
                                 pages_per_seq)
    q = rng.standard_normal((batch, num_heads, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


def ragged_inputs(rng, jnp, dtype, q_lens, num_tokens, num_heads, num_kv_heads, head_dim,
                  block_size, pages_per_seq):
    """Sequences with the given chunk lengths plus one padding slot past num_seqs."""
    context = pages_per_seq * block_size
    num_seqs = len(q_lens)
    kv_lens = np.array([rng.integers(max(q, 1), context + 1) for q in q_lens])
    k, v, tables = poisoned_pool(rng, kv_lens, num_kv_heads, block_size, head_dim,
                                 pages_per_seq)
    tables = np.concatenate([tables, np.zeros((1, pages_per_seq), np.int32)])
    kv_lens = np.concatenate([kv_lens, [context]]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_heads, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.int32(num_seqs))


# --- measurement -------------------------------------------------------------------------------

def bench(jax, fn, *args, reps=5, min_rep_s=0.02):
    """Median seconds per call; calls are queued back to back and synchronised per rep."""
    jax.block_until_ready(fn(*args))                          # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(1, int(min_rep_s / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def rel_error(jnp, out, ref):
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


class Run:
    """Collects results and saves them after every section."""

    def __init__(self, out_dir, dry, budget_s):
        self.path = Path(out_dir) / "kernels.json"
        self.start = time.time()
        self.budget_s = budget_s
        self.data = {"dry_run": dry, "budget_s": budget_s, "sections": {}, "errors": {},
                     "skipped": {}}

    def save(self):
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def section(self, name, fn, required=False):
        if not required and self.over_budget():
            self.data["skipped"][name] = f"time budget ({self.budget_s:.0f}s) spent"
            print(f"[gpu_check] {name}: skipped (budget)", flush=True)
            self.save()
            return
        t0 = time.time()
        try:
            self.data["sections"][name] = fn()
        except Exception as e:  # keep going: one broken section must not hide the others
            self.data["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            print(f"[gpu_check] section {name} FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"[gpu_check] {name}: {time.time() - t0:.1f}s", flush=True)
        self.save()

    def over_budget(self):
        return time.time() - self.start > self.budget_s


# --- sections ----------------------------------------------------------------------------------

def availability(jax):
    """What the engine would run here."""
    from pallas_kernels.availability import triton_import_error, triton_unavailable_reason
    info = {"triton_import_error": triton_import_error()}
    info["triton_unavailable_reason"] = triton_unavailable_reason()
    info["pallas_available"] = info["triton_unavailable_reason"] is None
    try:
        from jaxbatch.worker.attention import resolve_backend
        info["auto_backend"] = resolve_backend("auto")
    except Exception as e:          # the jaxbatch package is optional for the kernel checks
        info["auto_backend"] = f"unknown ({type(e).__name__}: {e})"
    return info


def _xla_decode(jax, jnp, args, scales=None):
    """The xla path's decode on `decode_inputs` args (block tables -> work items, on the host
    as the runner does it); `scales` = dict(k_scales, v_scales) for an int8 pool."""
    from pallas_kernels.xla_paged_attention import (decode_work_items, num_decode_items,
                                                    paged_decode_attention_xla)
    q, k, v, tables, lengths = args
    lengths_np, tables_np = np.asarray(lengths), np.asarray(tables)
    block_size = k.shape[2]
    live = [(i, tables_np[i].tolist(), int(n)) for i, n in enumerate(lengths_np) if n > 0]
    bucket = max(1, num_decode_items(lengths_np, block_size))
    items = decode_work_items(live, len(lengths_np), block_size, bucket)
    return jax.jit(paged_decode_attention_xla)(q, k, v, *(jnp.asarray(a) for a in items), lengths,
                                               **(scales or {}))


def _xla_prefill(jax, jnp, args):
    """The xla path's prefill on `ragged_inputs` args: each chunk padded to whole query tiles,
    every tile carrying its sequence's block table. Returns the output in the ragged layout."""
    from pallas_kernels.xla_paged_attention import PREFILL_TILE, tiled_prefill_attention_xla
    q, k, v, kv_lens, tables, cu, num_seqs = args
    cu_np, kv_np, tables_np = np.asarray(cu), np.asarray(kv_lens), np.asarray(tables)
    n_seqs = int(num_seqs)
    q_lens = [int(cu_np[i + 1] - cu_np[i]) for i in range(n_seqs)]
    tiles = [-(-n // PREFILL_TILE) for n in q_lens]
    total = sum(tiles) * PREFILL_TILE or PREFILL_TILE
    rows = np.zeros(total, np.int32)              # tiled row -> ragged row (valid where pos >= 0)
    query_pos = np.full(total, -1, np.int32)
    tile_pages = np.zeros((max(1, sum(tiles)), tables_np.shape[1]), np.int32)
    t = 0
    for i, n in enumerate(q_lens):
        base = t * PREFILL_TILE
        rows[base:base + n] = cu_np[i] + np.arange(n)
        query_pos[base:base + n] = kv_np[i] - n + np.arange(n)
        tile_pages[t:t + tiles[i]] = tables_np[i]
        t += tiles[i]
    q_tiled = jnp.where(jnp.asarray(query_pos >= 0)[:, None, None], q[jnp.asarray(rows)], 0)
    out = jax.jit(tiled_prefill_attention_xla)(q_tiled, k, v, jnp.asarray(query_pos),
                                               jnp.asarray(tile_pages))
    ragged = jnp.zeros_like(q).at[jnp.asarray(rows[query_pos >= 0])].set(out[query_pos >= 0])
    return ragged


def correctness(jax, jnp, rng, dry, interpret, pallas_available):
    from pallas_kernels import (paged_decode_attention_ref, ragged_paged_attention_ref,
                                write_kv, write_kv_ref)
    if pallas_available:
        from pallas_kernels import paged_decode_attention, ragged_paged_attention
    corrupt = simulated_failure("kernels")
    # (num_heads, num_kv_heads, head_dim, block_size): a Llama-8B layer and SmolLM2-135M.
    shapes = [(32, 8, 128, 16), (9, 3, 64, 16)] if not dry else [(8, 2, 64, 16)]
    rows = []

    def record(kernel, case, out, ref, dtype, zero_rows):
        if corrupt and not rows:            # GPU_CHECK_SIMULATE_FAILURE=kernels
            out = out + 0.1 * jnp.abs(ref.astype(jnp.float32)).max().astype(out.dtype)
        err = rel_error(jnp, out, ref)
        zeros_ok = bool((np.asarray(out[zero_rows].astype(jnp.float32)) == 0).all())
        rows.append(dict(kernel=kernel, case=case, rel_err=err, zeros_ok=zeros_ok,
                         ok=err < TOLERANCE[jnp.dtype(dtype).name] and zeros_ok))

    # A dry run checks the script: float32 only (the tightest tolerance), to keep it short.
    for dtype in (jnp.bfloat16, jnp.float32) if not dry else (jnp.float32,):
        for h, kvh, d, bs in shapes:
            name = f"{jnp.dtype(dtype).name} H{h}/KVH{kvh}/D{d}/bs{bs}"
            pages = 4 if dry else 64
            args = decode_args = decode_inputs(rng, jnp, dtype, 3 if dry else 16, h, kvh, d, bs,
                                               pages)
            ref = paged_decode_attention_ref(*args)
            if pallas_available:
                for splits in (1, None):
                    out = paged_decode_attention(*args, num_splits=splits, interpret=interpret)
                    record("paged_decode", f"{name} splits={splits}", out, ref, dtype, 0)
            record("xla_decode", name, _xla_decode(jax, jnp, args), ref, dtype, 0)
            q_lens = [1, 37, 0, 5, 1] if dry else [1, 300, 0, 77, 1, 1, 513, 9]
            args = ragged_inputs(rng, jnp, dtype, q_lens, 64 if dry else 1024, h, kvh, d, bs,
                                 pages)
            ref = ragged_paged_attention_ref(*args)
            pad = slice(sum(q_lens), None)
            if pallas_available:
                out = ragged_paged_attention(*args, interpret=interpret)
                record("ragged", name, out, ref, dtype, pad)
            record("xla_prefill", name, _xla_prefill(jax, jnp, args), ref, dtype, pad)
            # The same inputs on an int8 pool, against the oracle over the dequantized pool.
            gpu_check_int8.correctness_cases(
                jnp, rng, decode_args, args, interpret, pallas_available, record,
                lambda a, scales: _xla_decode(jax, jnp, a, scales))
    pool = jnp.zeros((2, 8, 16, 64), jnp.bfloat16)
    slots = jnp.asarray(rng.choice(8 * 16, 12, replace=False), jnp.int32)
    kv = jnp.asarray(rng.standard_normal((12, 2, 64)), jnp.float32)
    got, want = write_kv(pool, pool, kv, -kv, slots), write_kv_ref(pool, pool, kv, -kv, slots)
    same = all(bool((a == b).all()) for a, b in zip(got, want))
    rows.append(dict(kernel="write_kv", case="bf16 pool", rel_err=0.0 if same else 1.0,
                     zeros_ok=True, ok=same))
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows),
            "pallas_checked": pallas_available, "simulated_failure": corrupt}


def copy_bandwidth(jax, jnp, dry):
    n = (1 << 20) if dry else (1 << 29)                       # bf16 elements: 2 MiB / 1 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: -a)                              # read n, write n: a plain copy
    read = jax.jit(lambda a: jnp.max(a))                      # read n only
    t_copy, t_read = bench(jax, copy, x), bench(jax, read, x)
    nbytes = n * 2
    return {"bytes": nbytes, "copy_GBps": 2 * nbytes / t_copy / 1e9,
            "read_GBps": nbytes / t_read / 1e9}


def decode_headline(jax, jnp, run, rng, dry, interpret):
    from pallas_kernels import paged_decode_attention, paged_decode_attention_ref
    cfg = dict(HEADLINE) if not dry else dict(batch=4, context=64, num_heads=8, num_kv_heads=2,
                                              head_dim=64, block_size=16)
    b, ctx, h, kvh, d, bs = (cfg[k] for k in ("batch", "context", "num_heads", "num_kv_heads",
                                              "head_dim", "block_size"))
    pages = ctx // bs
    key = jax.random.key(int(rng.integers(1 << 31)))
    kq, kk, kv, kt = jax.random.split(key, 4)
    pool_shape = (kvh, b * pages + 1, bs, d)
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    k_pages = jax.random.normal(kk, pool_shape, jnp.bfloat16)
    v_pages = jax.random.normal(kv, pool_shape, jnp.bfloat16)
    tables = (jax.random.permutation(kt, b * pages) + 1).reshape(b, pages).astype(jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    kv_bytes = 2 * b * ctx * kvh * d * 2                      # K and V, bf16, all pages used
    ref = None
    sweep = [dict()] + ([] if dry else [
        dict(pages_per_compute_block=2), dict(pages_per_compute_block=8),
        dict(num_splits=1), dict(num_splits=4), dict(num_splits=8),
        dict(num_warps=8), dict(num_stages=3), dict(pages_per_compute_block=8, num_warps=8)])
    ours, skipped = [], []
    for params in sweep:
        if ours and run.over_budget():           # the default point always runs
            skipped.append(params)
            continue
        fn = jax.jit(lambda *a, p=params: paged_decode_attention(*a, interpret=interpret, **p))
        try:
            t = bench(jax, fn, q, k_pages, v_pages, tables, lengths)
            out = fn(q, k_pages, v_pages, tables, lengths)
            if ref is None:
                ref, ref_params = out, params
            ours.append(dict(params=params, us=t * 1e6, GBps=kv_bytes / t / 1e9,
                             max_diff_vs_default=float(jnp.abs(
                                 out.astype(jnp.float32) - ref.astype(jnp.float32)).max())))
            del out
        except Exception as e:
            ours.append(dict(params=params, error=f"{type(e).__name__}: {e}"))
    if ref is not None:
        want = paged_decode_attention_ref(q, k_pages, v_pages, tables, lengths)
        err = rel_error(jnp, ref, want)
        entry = next(r for r in ours if r["params"] is ref_params)
        entry["rel_err_vs_reference"] = err
        entry["ok"] = err < TOLERANCE["bfloat16"]
    # JAX's shipped kernel: optional (its module may move or go with the Triton backend).
    shipped_runs = []
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    except Exception as e:
        shipped_runs.append(dict(params={}, error=f"not importable: {type(e).__name__}: {e}"))
        shipped = None
    # JAX's kernel does not scale the logits: give it q * D**-0.5 so the outputs are comparable.
    q_shipped = (q.astype(jnp.float32) * d ** -0.5).astype(q.dtype)
    shipped_sweep = [] if shipped is None else [dict()] if dry else [
        dict(), dict(k_splits=4), dict(k_splits=8)]
    for params in shipped_sweep:
        if shipped_runs and run.over_budget():
            skipped.append(dict(shipped=params))
            continue
        p = dict(params, **({"k_splits": 2, "pages_per_compute_block": 1} if dry else {}))
        fn = jax.jit(lambda *a, p=p: shipped.paged_attention(*a, interpret=interpret, **p))
        try:
            t = bench(jax, fn, q_shipped, k_pages, v_pages, tables, lengths)
            out = fn(q_shipped, k_pages, v_pages, tables, lengths)
            diff = (float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
                    if ref is not None else None)
            shipped_runs.append(dict(params=params, us=t * 1e6, GBps=kv_bytes / t / 1e9,
                                     max_diff_vs_ours=diff))
        except Exception as e:
            shipped_runs.append(dict(params=params, error=f"{type(e).__name__}: {e}"))
    return {"shape": cfg, "kv_bytes": kv_bytes, "ours": ours, "shipped": shipped_runs,
            "skipped_for_budget": skipped}


def ragged_timings(jax, jnp, run, dry, interpret):
    from pallas_kernels import ragged_paged_attention
    h, kvh, d, bs = (32, 8, 128, 16) if not dry else (8, 2, 64, 16)
    ctx = 4096 if not dry else 64
    pages = ctx // bs

    def case(q_lens, kv_lens, num_tokens):
        s = len(q_lens)
        key = jax.random.key(len(q_lens) * 7919 + num_tokens)
        kq, kk, kv = jax.random.split(key, 3)
        pool = (kvh, s * pages + 1, bs, d)
        tables = (jnp.arange(s * pages, dtype=jnp.int32) + 1).reshape(s, pages)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        args = (jax.random.normal(kq, (num_tokens, h, d), jnp.bfloat16),
                jax.random.normal(kk, pool, jnp.bfloat16), jax.random.normal(kv, pool, jnp.bfloat16),
                jnp.asarray(kv_lens, jnp.int32), tables, jnp.asarray(cu), jnp.int32(s))
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret))
        t = bench(jax, fn, *args)
        keys_read = sum(kv_lens)
        flops = 4 * h * d * sum(sum(range(kl - ql + 1, kl + 1)) for ql, kl in zip(q_lens, kv_lens))
        return dict(us=t * 1e6, kv_GBps=2 * keys_read * kvh * d * 2 / t / 1e9,
                    TFLOPs=flops / t / 1e12, num_tokens=num_tokens, num_seqs=s)

    cases = ({"mixed": ([16] + [1] * 3, [ctx // 2] + [ctx] * 3, 32)} if dry else
             {"decode_only_B64": ([1] * 64, [ctx] * 64, 64),
              "prefill_2048_at_4096": ([2048], [ctx], 2048),
              "mixed_512_plus_63_decode": ([512] + [1] * 63, [2048] + [ctx] * 63, 576)})
    out = {}
    for name, spec in cases.items():
        if out and run.over_budget():
            out[name] = {"skipped": "budget"}
            continue
        out[name] = case(*spec)
    return out


def kv_write_timing(jax, jnp, dry):
    from pallas_kernels import write_kv_jit
    kvh, d, bs, blocks = (8, 128, 16, 16385) if not dry else (2, 64, 16, 17)
    pool = jnp.zeros((kvh, blocks, bs, d), jnp.bfloat16)
    state = {"k": pool, "v": pool + 0}
    rows = {}
    for tokens in ((64, 2048) if not dry else (4, 32)):
        kv = jnp.ones((tokens, kvh, d), jnp.bfloat16)
        slots = jnp.arange(tokens, dtype=jnp.int32) * 3 + bs

        def step():                       # the pool is donated and rebound, as in the runner
            state["k"], state["v"] = write_kv_jit(state["k"], state["v"], kv, kv, slots)
            return state["k"]
        t = bench(jax, lambda: step())
        rows[f"T{tokens}"] = dict(us=t * 1e6, bytes_written=2 * tokens * kvh * d * 2)
    return rows


def env_info(jax):
    info = {"python": platform.python_version(), "jax": jax.__version__,
            "devices": [str(dv) for dv in jax.devices()],
            "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend()}
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = "not importable (jaxlib bundles its own)"
    return info


def run_kernels(out_dir, dry, budget_s):
    import jax
    import jax.numpy as jnp
    if not dry and jax.default_backend() != "gpu":
        sys.exit(f"gpu_check: no GPU (backend {jax.default_backend()}); use --dry-run")
    interpret = dry
    seed = int(os.environ.get("GPU_CHECK_SEED", int.from_bytes(os.urandom(4), "little")))
    rng = np.random.default_rng(seed)
    run = Run(out_dir, dry, budget_s)
    run.data.update(seed=seed, env=env_info(jax))
    run.section("availability", lambda: availability(jax), required=True)
    avail = run.data["sections"].get("availability", {})
    # Interpret mode needs only the module; on a GPU the kernels must also lower.
    if dry:
        from pallas_kernels.availability import triton_import_error
        pallas_ok = triton_import_error() is None
    else:
        pallas_ok = bool(avail.get("pallas_available"))
    run.section("correctness", lambda: correctness(jax, jnp, rng, dry, interpret, pallas_ok),
                required=True)
    if simulated_failure("timeout"):      # a hang: gpu_check.sh's limit for this section kills it
        print("[gpu_check] GPU_CHECK_SIMULATE_FAILURE=timeout: hanging", flush=True)
        time.sleep(10 ** 6)
    run.section("copy_bandwidth", lambda: copy_bandwidth(jax, jnp, dry))
    if pallas_ok:
        run.section("decode_headline", lambda: decode_headline(jax, jnp, run, rng, dry, interpret))
        run.section("ragged", lambda: ragged_timings(jax, jnp, run, dry, interpret))
    else:
        for name in ("decode_headline", "ragged"):
            run.data["skipped"][name] = "Pallas Triton kernels unavailable on this jax"
    run.section("kv_write", lambda: kv_write_timing(jax, jnp, dry))
    if pallas_ok:
        run.section("int8_decode", lambda: gpu_check_int8.decode_kernel_timing(
            jax, jnp, bench, HEADLINE, dry, interpret))
    else:
        run.data["skipped"]["int8_decode"] = "Pallas Triton kernels unavailable on this jax"
    run.section("int8_weights", lambda: gpu_check_int8.weight_matmul_timing(jax, jnp, bench, dry))
    run.data["elapsed_s"] = time.time() - run.start
    run.data["finished"] = True
    run.save()


# --- report ------------------------------------------------------------------------------------

def summarize(data):
    """Headline numbers and pass/fail against the targets."""
    s = data.get("sections", {})
    out = {}
    corr = s.get("correctness")
    if corr:
        worst = {}
        for r in corr["cases"]:
            dt = r["case"].split()[0] if r["kernel"] != "write_kv" else "write_kv"
            worst[dt] = max(worst.get(dt, 0.0), r["rel_err"])
        out["correctness"] = dict(ok=corr["all_ok"], cases=len(corr["cases"]), worst=worst,
                                  failed=[f"{r['kernel']} {r['case']}" for r in corr["cases"]
                                          if not r["ok"]])
    bw = s.get("copy_bandwidth", {}).get("copy_GBps")
    dec = s.get("decode_headline")
    if dec:
        ours = [r for r in dec["ours"] if "us" in r]
        shipped = [r for r in dec["shipped"] if "us" in r]
        if ours:
            best, default = min(ours, key=lambda r: r["us"]), ours[0]
            out["decode"] = dict(default=default, best=best)
            if bw:
                out["decode"]["copy_fraction_default"] = default["GBps"] / bw
                out["decode"]["copy_fraction_best"] = best["GBps"] / bw
            if shipped:
                ref = shipped[0]                     # JAX's kernel at its default settings
                out["decode"]["speedup_vs_shipped_default"] = ref["us"] / default["us"]
                out["decode"]["speedup_best_vs_best_shipped"] = (
                    min(r["us"] for r in shipped) / best["us"])
    return out


def verdict(data, kernels_rc, e2e):
    """(exit status, reasons): 0 pass, 1 failure, 3 incomplete."""
    failures, incomplete = [], []
    if kernels_rc in TIMEOUT_CODES:
        failures.append(f"kernels section TIMED OUT (rc={kernels_rc})")
    elif kernels_rc not in (None, "0"):
        failures.append(f"kernels section exited rc={kernels_rc}")
    elif kernels_rc is None:
        failures.append("kernels section did not record an exit code")
    if data.get("missing"):
        failures.append("kernels.json missing")
    corr = data.get("sections", {}).get("correctness")
    if corr is None:
        failures.append("kernel correctness did not run")
    elif not corr["all_ok"]:
        bad = [f"{r['kernel']} {r['case']}" for r in corr["cases"] if not r["ok"]]
        failures.append(f"kernel correctness FAILED: {', '.join(bad)}")
    for name in data.get("errors", {}):
        failures.append(f"section {name} raised")
    dec = data.get("sections", {}).get("decode_headline")
    if dec and dec["ours"]:
        default = dec["ours"][0]
        if "error" in default:
            failures.append(f"decode kernel (default settings) raised: {default['error'][:80]}")
        elif default.get("ok") is False:
            failures.append("decode kernel at the headline shape disagrees with the reference")
    rc = e2e.get("rc")
    if rc is None:
        failures.append("end-to-end section did not run")
    elif rc in TIMEOUT_CODES:
        failures.append(f"end-to-end section TIMED OUT (rc={rc})")
    elif rc == "3":
        incomplete.append("end-to-end: a model was skipped for time")
    elif rc != "0":
        failures.append(f"end-to-end section FAILED (rc={rc})")
    if failures:
        return 1, failures + incomplete
    if incomplete:
        return 3, incomplete
    return 0, []


def markdown(data, summary, e2e, status, reasons):
    lines = ["| check | result | target |", "|---|---|---|"]
    add = lambda *c: lines.append("| " + " | ".join(str(x) for x in c) + " |")  # noqa: E731
    env = data.get("env", {})
    add("device / jax", f"{env.get('device_kind', '?')} / jax {env.get('jax', '?')}"
        + (" (DRY RUN, interpret)" if data.get("dry_run") else ""), "")
    av = data.get("sections", {}).get("availability")
    if av:
        add("kernel path", f"auto -> {av.get('auto_backend')}; Pallas Triton "
            + ("OK" if av.get("pallas_available") else
               f"UNAVAILABLE: {str(av.get('triton_unavailable_reason'))[:80]}"), "")
    c = summary.get("correctness")
    if c:
        worst = ", ".join(f"{k} {v:.1e}" for k, v in c["worst"].items())
        add("correctness", f"{'PASS' if c['ok'] else 'FAIL'} ({c['cases']} cases; worst {worst})"
            + ("" if c["ok"] else f"; failed: {', '.join(c['failed'])[:120]}"),
            "f32 < 1e-5, bf16 < 1e-2")
    bw = data.get("sections", {}).get("copy_bandwidth")
    if bw:
        add("copy bandwidth", f"{bw['copy_GBps']:.0f} GB/s (read-only {bw['read_GBps']:.0f})", "")
    dec = summary.get("decode")
    if dec:
        for label in ("default", "best"):
            r = dec[label]
            frac = dec.get(f"copy_fraction_{label}")
            err = r.get("rel_err_vs_reference")
            add(f"decode {label} {r['params'] or ''}".strip(),
                f"{r['us']:.1f} us, {r['GBps']:.0f} GB/s"
                + (f", {100 * frac:.0f}% of copy" if frac else "")
                + (f", rel err vs ref {err:.1e}" if err is not None else ""), ">= 85% of copy")
        if "speedup_vs_shipped_default" in dec:
            add("decode vs JAX shipped (default / best-vs-best)",
                f"{dec['speedup_vs_shipped_default']:.2f}x / "
                f"{dec['speedup_best_vs_best_shipped']:.2f}x", ">= 1.2x")
    for name, r in data.get("sections", {}).get("ragged", {}).items():
        if "us" in r:
            add(f"ragged {name}", f"{r['us']:.1f} us, KV {r['kv_GBps']:.0f} GB/s, "
                f"{r['TFLOPs']:.1f} TFLOP/s", "")
    for name, r in data.get("sections", {}).get("kv_write", {}).items():
        add(f"kv_write {name}", f"{r['us']:.1f} us", "in place (no pool copy)")
    r = data.get("sections", {}).get("int8_decode")
    if r:
        add("decode kernel int8 KV vs bf16 KV", f"{r['int8_us']:.1f} vs {r['bf16_us']:.1f} us "
            f"({r['speedup_int8']:.2f}x; {r['int8_GBps']:.0f} vs {r['bf16_GBps']:.0f} GB/s)",
            "faster (reads 0.53x the bytes)")
    for name, r in data.get("sections", {}).get("int8_weights", {}).items():
        add(f"8B MLP matmuls {name}: int8 vs bf16 weights", f"{r['int8_us']:.1f} vs "
            f"{r['bf16_us']:.1f} us ({r['speedup_int8']:.2f}x)", "faster (half the bytes)")
    for name, why in data.get("skipped", {}).items():
        add(f"section {name}", f"skipped: {why}", "")
    for name in data.get("errors", {}):
        add(f"section {name}", "ERROR (see kernels.json)", "")
    for row in e2e.get("table_rows", []):
        add(*row)
    add("end-to-end", e2e.get("summary", "n/a"), "")
    add("VERDICT", {0: "PASS", 1: "FAIL", 3: "INCOMPLETE"}[status]
        + (": " + "; ".join(reasons) if reasons else ""), "exit status " + str(status))
    return "\n".join(lines)


def read_e2e(out_dir):
    rc_path, log_path = out_dir / "e2e.rc", out_dir / "e2e.log"
    if (out_dir / "e2e.skipped").exists():
        return {"summary": (out_dir / "e2e.skipped").read_text().strip(), "rc": None}
    if not rc_path.exists():
        return {"summary": "did not run", "rc": None}
    rc = rc_path.read_text().strip()
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    e2e = {"rc": rc, "log_tail": log[-4000:]}
    last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [""]
    e2e["summary"] = (f"rc={rc}" + (" (TIMED OUT)" if rc in TIMEOUT_CODES else "")
                      + f"; {last[0][:160]}")
    json_path = out_dir / "gpu_e2e.json"
    if json_path.exists():
        try:
            report = json.loads(json_path.read_text())
            e2e["report"] = report
            rows = []
            for r in report.get("models", []):
                if "speed" in r:
                    s, c = r["speed"], r["check"]
                    rows.append((f"e2e {r['model']} {r['dtype']} ({s['backend']})",
                                 f"{s['decode_tokens_per_s'] or 0:.0f} decode tok/s, "
                                 f"{s['e2e_output_tokens_per_s']:.0f} e2e tok/s; greedy vs "
                                 f"reference {'PASS' if c['equal'] else 'FAIL'}"
                                 f" ({c['near_ties']} near-ties, tol {c['tolerance']:.2g})",
                                 "0 compiles in timed run" if s["compilations_timed"] == 0
                                 else f"COMPILED {s['compilations_timed']}x IN TIMED RUN"))
                else:
                    rows.append((f"e2e {r['model']}", ("ERROR " + r["error"][:100]) if "error" in r
                                 else "SKIPPED: " + r.get("skipped", "?"), ""))
            e2e["table_rows"] = rows
        except (OSError, ValueError, KeyError, TypeError) as e:
            e2e["report_error"] = f"{type(e).__name__}: {e}"
    return e2e


def run_report(out_dir):
    out_dir = Path(out_dir)
    kpath = out_dir / "kernels.json"
    data = json.loads(kpath.read_text()) if kpath.exists() else {"missing": True}
    krc_path = out_dir / "kernels.rc"
    kernels_rc = krc_path.read_text().strip() if krc_path.exists() else None
    e2e = read_e2e(out_dir)
    summary = summarize(data)
    status, reasons = verdict(data, kernels_rc, e2e)
    results = {"status": {0: "pass", 1: "fail", 3: "incomplete"}[status], "reasons": reasons,
               "exit_status": status, "kernels_rc": kernels_rc, "summary": summary,
               "kernels": data, "e2e": e2e}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(markdown(data, summary, e2e, status, reasons), flush=True)
    return status


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("kernels", "report"))
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_out")
    ap.add_argument("--dry-run", action="store_true",
                    default=os.environ.get("DRY_RUN", "0") not in ("", "0"))
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="kernels: no new timing work after this many seconds")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.mode == "kernels":
        if args.dry_run:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        run_kernels(args.out, args.dry_run, args.budget_s)
        return 0
    return run_report(args.out)


if __name__ == "__main__":
    sys.exit(main())
