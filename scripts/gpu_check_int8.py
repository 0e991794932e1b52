"""int8 sections of scripts/gpu_check.py: the int8 KV kernels' correctness, and int8 vs bf16
timings (the decode kernel on an int8 pool vs a bf16 pool; an int8-weight decode matmul vs a
bf16 one). Kept apart so gpu_check.py stays one concept per section.

Correctness cases reuse gpu_check's float inputs (NaN in every slot that must not be read) and
quantize them: unread slots get random int8 values and a NaN scale. The oracle is the plain-jnp
reference over the dequantized pool, so the check isolates the kernels' int8 handling from the
(intended) quantization error.
"""
from __future__ import annotations

import numpy as np


def int8_pool(jnp, rng, k, v):
    """Float pages (NaN = never written) -> ((k8, v8, k_scales, v_scales), (k_deq, v_deq))."""
    from pallas_kernels.int8 import dequantize_int8, quantize_int8
    out, deq = [], []
    for pages in (np.asarray(k, np.float32), np.asarray(v, np.float32)):
        written = np.isfinite(pages).all(axis=-1)
        q, s = quantize_int8(np.where(written[..., None], pages, 0.0))
        q = np.where(written[..., None], q, rng.integers(-127, 128, q.shape)).astype(np.int8)
        s = np.where(written, s, np.nan).astype(np.float32)
        out += [jnp.asarray(q), jnp.asarray(s)]
        deq.append(jnp.asarray(np.asarray(dequantize_int8(q, s))))
    k8, ks, v8, vs = out
    return (k8, v8, ks, vs), tuple(deq)


def correctness_cases(jnp, rng, decode_args, ragged_args, interpret, pallas_available, record,
                      xla_decode):
    """Adds int8-pool rows to gpu_check's correctness table via `record(kernel, case, out,
    ref, dtype, zero_rows)`. decode_args / ragged_args: gpu_check's float inputs."""
    from pallas_kernels import paged_decode_attention_ref, ragged_paged_attention_ref
    q, k, v, tables, lengths = decode_args
    pool, (kd, vd) = int8_pool(jnp, rng, k, v)
    scales = dict(k_scales=pool[2], v_scales=pool[3])
    name = f"{jnp.dtype(q.dtype).name} int8-KV H{q.shape[1]}/KVH{k.shape[0]}/D{k.shape[3]}"
    ref = paged_decode_attention_ref(q, kd, vd, tables, lengths)
    if pallas_available:
        from pallas_kernels import paged_decode_attention, ragged_paged_attention
        for splits in (1, None):
            out = paged_decode_attention(q, pool[0], pool[1], tables, lengths, num_splits=splits,
                                         interpret=interpret, **scales)
            record("paged_decode_int8", f"{name} splits={splits}", out, ref, q.dtype, 0)
    record("xla_decode_int8", name, xla_decode((q, pool[0], pool[1], tables, lengths), scales),
           ref, q.dtype, 0)
    q, k, v, kv_lens, tables, cu, num_seqs = ragged_args
    pool, (kd, vd) = int8_pool(jnp, rng, k, v)
    ref = ragged_paged_attention_ref(q, kd, vd, kv_lens, tables, cu, num_seqs)
    pad = slice(int(cu[int(num_seqs)]), None)
    if pallas_available:
        out = ragged_paged_attention(q, pool[0], pool[1], kv_lens, tables, cu, num_seqs,
                                     interpret=interpret, k_scales=pool[2], v_scales=pool[3])
        record("ragged_int8", name, out, ref, q.dtype, pad)


def decode_kernel_timing(jax, jnp, bench, headline, dry, interpret):
    """The decode kernel at the headline shape on a bf16 pool and on an int8 pool (same
    tables, lengths, defaults): microseconds and the bytes each had to read."""
    from pallas_kernels import paged_decode_attention
    from pallas_kernels.int8 import quantize_int8
    cfg = dict(batch=4, context=64, num_heads=8, num_kv_heads=2, head_dim=64,
               block_size=16) if dry else headline
    b, ctx, h, kvh, d, bs = (cfg[k] for k in ("batch", "context", "num_heads", "num_kv_heads",
                                              "head_dim", "block_size"))
    pages = ctx // bs
    kq, kk, kv, kt = jax.random.split(jax.random.key(13), 4)
    shape = (kvh, b * pages + 1, bs, d)
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    tables = (jax.random.permutation(kt, b * pages) + 1).reshape(b, pages).astype(jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    (k8, ks), (v8, vs) = quantize_int8(k), quantize_int8(v)
    tokens = 2 * b * ctx * kvh                                   # K and V token-heads read
    fn = jax.jit(lambda *a, **s: paged_decode_attention(*a, interpret=interpret, **s))
    t_bf16 = bench(jax, fn, q, k, v, tables, lengths)
    int8_fn = jax.jit(lambda q, k, v, t, n, ks, vs: paged_decode_attention(
        q, k, v, t, n, k_scales=ks, v_scales=vs, interpret=interpret))
    t_int8 = bench(jax, int8_fn, q, k8, v8, tables, lengths, ks, vs)
    out16 = fn(q, k, v, tables, lengths).astype(jnp.float32)
    out8 = int8_fn(q, k8, v8, tables, lengths, ks, vs).astype(jnp.float32)
    return {"shape": cfg, "bf16_us": t_bf16 * 1e6, "int8_us": t_int8 * 1e6,
            "speedup_int8": t_bf16 / t_int8,
            "bf16_GBps": tokens * d * 2 / t_bf16 / 1e9,
            "int8_GBps": tokens * (d + 4) / t_int8 / 1e9,
            "max_abs_diff_int8_vs_bf16": float(jnp.abs(out8 - out16).max())}


def weight_matmul_timing(jax, jnp, bench, dry):
    """One decode step's worth of Llama-8B MLP matmuls (x [B, 4096] @ [4096, 14336] and back)
    with bf16 weights vs int8 weights (convert fused into the GEMM, scale after the dot)."""
    from jaxbatch.model.linear import Int8
    from jaxbatch.model.quantize import quantize_matrix

    def int8_matmul(x, q):
        return Int8(q["int8"], q["scale"]).apply(x)
    d, f = (64, 128) if dry else (4096, 14336)
    rows = {}
    for batch in ((4,) if dry else (16, 64)):
        kx, kw, kd = jax.random.split(jax.random.key(batch), 3)
        x = jax.random.normal(kx, (batch, d), jnp.bfloat16)
        w_up = jax.random.normal(kw, (d, f), jnp.bfloat16) * 0.02
        w_down = jax.random.normal(kd, (f, d), jnp.bfloat16) * 0.02
        q_up, q_down = quantize_matrix(w_up), quantize_matrix(w_down)
        dense = jax.jit(lambda x, a, b: (x @ a) @ b)
        quant = jax.jit(lambda x, a, b: int8_matmul(int8_matmul(x, a), b))
        t16 = bench(jax, dense, x, w_up, w_down)
        t8 = bench(jax, quant, x, q_up, q_down)
        weight_bytes = 2 * d * f
        rows[f"B{batch}"] = {"bf16_us": t16 * 1e6, "int8_us": t8 * 1e6, "speedup_int8": t16 / t8,
                             "bf16_GBps": weight_bytes * 2 / t16 / 1e9,
                             "int8_GBps": (weight_bytes + 4 * (d + f)) / t8 / 1e9}
    return rows
