"""Every CPU kernel handler checks what it is handed (`cpu_kernels/checks.h`): a call whose
shapes, work list or page ids the kernel would misread raises a Python exception naming the
problem; a valid call at the edges (empty batches, the largest head dim and query group,
long contexts) computes what its reference computes.

The FFI targets are called directly (`jax.ffi.ffi_call`), past the Python wrappers' own
checks. Each case runs in a child process (`python this_file.py CASE...`), so a kernel that
crashes (SIGFPE, SIGSEGV) fails its case instead of killing pytest; the child reports one JSON
line per case, and after a crash the remaining cases run in a fresh child."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# ---- the cases, run in the child ---------------------------------------------------------

def _jnp():
    import jax
    import jax.numpy as jnp
    return jax, jnp


def _scalars(window=2 ** 30, scale=0.3):
    _, jnp = _jnp()
    return jnp.full((1,), window, jnp.int32), jnp.full((1,), scale, jnp.float32)


def _decode_inputs(seed=0, heads=4, kv_heads=2, head_dim=16, pages=8, block=16, ppi=2,
                   lengths=(40, 20)):
    """A valid float32-pool decode call: rows' pages 1.. in order, one padding item."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    q = rng.standard_normal((batch, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((kv_heads, pages, block, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv_heads, pages, block, head_dim)).astype(np.float32)
    slot, item_pages, first = [], [], []
    page = 1
    for row, length in enumerate(lengths):
        n_pages = -(-length // block)
        for i in range(0, n_pages, ppi):
            ids = [(page + j) % pages for j in range(min(ppi, n_pages - i))]
            page += len(ids)
            slot.append(row)
            item_pages.append(ids + [0] * (ppi - len(ids)))
            first.append(i * block)
    slot.append(batch)                          # padding
    item_pages.append([0] * ppi)
    first.append(0)
    return dict(q=q, k=k, v=v, slot=np.array(slot, np.int32),
                pages=np.array(item_pages, np.int32), first=np.array(first, np.int32),
                lengths=np.array(lengths, np.int32))


def _decode(d, target="jaxbatch_paged_decode_f32", out_shape=None, window=2 ** 30,
            next_layer_blocks=0, scalars=None):
    jax, jnp = _jnp()
    from cpu_kernels import paged_decode
    assert paged_decode.unavailable_reason() is None
    out_dtype = jnp.bfloat16 if target.endswith("bf16_out") else jnp.float32
    out = jax.ShapeDtypeStruct(out_shape or d["q"].shape, out_dtype)
    window, scale = scalars or _scalars(window)
    return jax.ffi.ffi_call(target, out)(
        jnp.asarray(d["q"]), jnp.asarray(d["k"]), jnp.asarray(d["v"]), jnp.asarray(d["slot"]),
        jnp.asarray(d["pages"]), jnp.asarray(d["first"]), jnp.asarray(d["lengths"]), window,
        scale, next_layer_blocks=np.int64(next_layer_blocks))


def _decode_reference(d, window=None):
    from pallas_kernels.xla_paged_attention import paged_decode_attention_xla
    _, jnp = _jnp()
    return paged_decode_attention_xla(*(jnp.asarray(d[n]) for n in
                                        ("q", "k", "v", "slot", "pages", "first", "lengths")),
                                      scale=0.3, window=window)


def _close(out, ref, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < tol, f"relative error {err:.3g} against the reference"


def d_valid():
    d = _decode_inputs()
    _close(_decode(d), _decode_reference(d), 2e-5)


def d_unsorted():
    """item_slot [0, 1, 0]: row 0's second item after row 1's."""
    d = _decode_inputs()
    order = [0, 2, 1, 3]
    for n in ("slot", "pages", "first"):
        d[n] = d[n][order]
    _decode(d)


def d_live_after_padding():
    d = _decode_inputs()
    order = [0, 1, 3, 2]
    for n in ("slot", "pages", "first"):
        d[n] = d[n][order]
    _decode(d)


def d_short_list():
    """Row 1 is 40 keys long, its one item covers 32."""
    d = _decode_inputs()
    d["lengths"] = np.array([40, 40], np.int32)
    _decode(d)


def d_item_arrays_disagree():
    d = _decode_inputs()
    d["pages"] = d["pages"][:3]
    _decode(d)


def d_v_fewer_pages():
    d = _decode_inputs()
    d["v"] = d["v"][:, :4]
    _decode(d)


def d_page_out_of_range():
    d = _decode_inputs()
    d["pages"][1, 0] = 99
    _decode(d)


def d_negative_page():
    d = _decode_inputs()
    d["pages"][0, 1] = -1
    _decode(d)


def d_negative_slot():
    d = _decode_inputs()
    d["slot"][3] = -1
    _decode(d)


def d_negative_length():
    d = _decode_inputs()
    d["lengths"][1] = -3
    _decode(d)


def d_first_position():
    d = _decode_inputs()
    d["first"][1] = 16
    _decode(d)


def d_zero_kv_heads():
    d = _decode_inputs()
    d["k"], d["v"] = d["k"][:0], d["v"][:0]
    _decode(d)


def d_zero_block_size():
    d = _decode_inputs()
    d["k"], d["v"] = d["k"][:, :, :0], d["v"][:, :, :0]
    _decode(d, next_layer_blocks=1)


def d_zero_head_dim():
    """An empty result: XLA calls no kernel for it (were it called, a head dim of 0 is
    refused)."""
    d = _decode_inputs()
    d["q"], d["k"], d["v"] = d["q"][..., :0], d["k"][..., :0], d["v"][..., :0]
    assert _decode(d, next_layer_blocks=1).shape == (2, 4, 0)


def d_empty_batch():
    """No rows: every item is padding; the result is empty."""
    d = _decode_inputs()
    d["q"], d["lengths"] = d["q"][:0], d["lengths"][:0]
    d["slot"][:] = 0
    out = _decode(d, next_layer_blocks=1)
    assert out.shape == (0, 4, 16)


def d_empty_window():
    _, jnp = _jnp()
    _decode(_decode_inputs(), scalars=(jnp.zeros((0,), jnp.int32), _scalars()[1]))


def d_out_shape():
    _decode(_decode_inputs(), out_shape=(2, 4, 8))


def d_group_too_large():
    _decode(_decode_inputs(heads=34))


def d_wrong_dtype():
    """float32 pages handed to the bf16-bits handler."""
    _decode(_decode_inputs(), target="jaxbatch_paged_decode")


def d_largest_head_dim_and_group():
    """head_dim 512, 16 query heads over one kv head: the most the kernel accepts."""
    d = _decode_inputs(heads=16, kv_heads=1, head_dim=512, lengths=(40, 17, 0))
    _close(_decode(d), _decode_reference(d), 2e-5)


def d_largest_bf16():
    jax, jnp = _jnp()
    from cpu_kernels import paged_decode
    from pallas_kernels.reference import BF16_BITS, keys_as_stored
    d = _decode_inputs(heads=16, kv_heads=1, head_dim=512, lengths=(40, 17))
    q = jnp.asarray(d["q"], jnp.bfloat16)
    k, v = jnp.asarray(d["k"], jnp.bfloat16), jnp.asarray(d["v"], jnp.bfloat16)
    bits = lambda a: jax.lax.bitcast_convert_type(a, BF16_BITS)
    kb, vb = keys_as_stored(bits(k), k.shape[2]), bits(v)
    items = [jnp.asarray(d[n]) for n in ("slot", "pages", "first", "lengths")]
    out = paged_decode.paged_decode_attention(q, kb, vb, *items, scale=0.3)
    from pallas_kernels.xla_paged_attention import paged_decode_attention_xla
    _close(out, paged_decode_attention_xla(q, kb, vb, *items, scale=0.3), 1e-2)


def d_long_context():
    """6000 and 4097 keys: 47 and 33 items of 8 pages, a window on top."""
    d = _decode_inputs(pages=700, ppi=8, lengths=(6000, 4097))
    _close(_decode(d), _decode_reference(d), 2e-5)
    _close(_decode(d, window=1000), _decode_reference(d, window=1000), 2e-5)


def _prefill_inputs(seed=0, heads=4, kv_heads=2, head_dim=16, pages=8, block=16, table=4,
                    positions=range(10, 26), tiles=1):
    """A valid prefill call: `tiles` tiles of the same sequence (pages 1..table)."""
    jax, jnp = _jnp()
    from pallas_kernels.reference import BF16_BITS, keys_as_stored
    rng = np.random.default_rng(seed)
    pos = np.array(list(positions), np.int32)
    q = jnp.asarray(rng.standard_normal((len(pos), heads, head_dim)), jnp.bfloat16)
    bits = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), BF16_BITS)
    k = keys_as_stored(bits(rng.standard_normal((kv_heads, pages, block, head_dim))), block)
    v = bits(rng.standard_normal((kv_heads, pages, block, head_dim)))
    tp = np.tile((np.arange(table, dtype=np.int32) + 1) % pages, (tiles, 1))
    return dict(q=q, k=k, v=v, pos=pos, table=tp)


def _prefill(d, out_shape=None, window=2 ** 30, scalars=None):
    jax, jnp = _jnp()
    from cpu_kernels import paged_prefill
    assert paged_prefill.unavailable_reason() is None
    out = jax.ShapeDtypeStruct(out_shape or d["q"].shape, jnp.float32)
    window, scale = scalars or _scalars(window)
    return jax.ffi.ffi_call(paged_prefill.TARGET, out)(
        d["q"], jnp.asarray(d["k"]), jnp.asarray(d["v"]), jnp.asarray(d["pos"]),
        jnp.asarray(d["table"]), window, scale)


def _prefill_reference(d, window=None):
    from pallas_kernels.xla_paged_attention import tiled_prefill_attention_xla
    _, jnp = _jnp()
    return tiled_prefill_attention_xla(d["q"], d["k"], d["v"], jnp.asarray(d["pos"]),
                                       jnp.asarray(d["table"]), scale=0.3, window=window)


def p_valid():
    d = _prefill_inputs()
    _close(_prefill(d), _prefill_reference(d), 1e-2)


def p_zero_kv_heads():
    d = _prefill_inputs()
    d["k"], d["v"] = d["k"][:0], d["v"][:0]
    _prefill(d)


def p_zero_block_size():
    d = _prefill_inputs()
    d["k"], d["v"] = d["k"][:, :, :0], d["v"][:, :, :0]
    _prefill(d)


def p_page_out_of_range():
    d = _prefill_inputs()
    d["table"][0, 1] = 99
    _prefill(d)


def p_position_past_table():
    _prefill(_prefill_inputs(positions=range(70, 86)))


def p_bad_position():
    d = _prefill_inputs()
    d["pos"][3] = -5
    _prefill(d)


def p_v_fewer_pages():
    d = _prefill_inputs()
    d["v"] = d["v"][:, :4]
    _prefill(d)


def p_tiles_do_not_divide():
    _prefill(_prefill_inputs(tiles=3))


def p_empty_window():
    _, jnp = _jnp()
    _prefill(_prefill_inputs(), scalars=(jnp.zeros((0,), jnp.int32), _scalars()[1]))


def p_no_tokens():
    d = _prefill_inputs(positions=[], tiles=0)
    assert _prefill(d).shape == (0, 4, 16)


def p_largest_head_dim_and_group():
    d = _prefill_inputs(heads=16, kv_heads=1, head_dim=512)
    _close(_prefill(d), _prefill_reference(d), 1e-2)


def p_long_context():
    """16 queries at positions 5000.., a table of 320 pages."""
    d = _prefill_inputs(pages=330, table=320, positions=range(5000, 5016))
    _close(_prefill(d), _prefill_reference(d), 1e-2)
    _close(_prefill(d, window=700), _prefill_reference(d, window=700), 1e-2)


def _gemm(x, w, rows, y_shape, target="jaxbatch_packed_gemm_f32"):
    jax, jnp = _jnp()
    from cpu_kernels import packed_gemm
    assert packed_gemm.unavailable_reason() is None
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(y_shape, jnp.float32))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(rows, jnp.int32))


def _packed(k, n):
    from cpu_kernels import packed_gemm
    return packed_gemm.pack(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32))


def g_k_mismatch():
    _gemm(np.ones((4, 64), np.float32), _packed(32, 32), [4], (4, 32))


def g_rows_shape():
    _gemm(np.ones((4, 32), np.float32), _packed(32, 32), [4, 4], (4, 32))


def g_y_shape():
    _gemm(np.ones((4, 32), np.float32), _packed(32, 32), [4], (4, 48))


def g_no_rows():
    assert _gemm(np.ones((0, 32), np.float32), _packed(32, 32), [0], (0, 32)).shape == (0, 32)


def g_no_inputs():
    """K = 0: an empty sum, zeros."""
    y = _gemm(np.ones((4, 0), np.float32), np.zeros((2, 0, 16), np.float32), [4], (4, 32))
    assert (np.asarray(y) == 0).all()


def g_silu_odd_blocks():
    jax, jnp = _jnp()
    from cpu_kernels import packed_gemm
    assert packed_gemm.unavailable_reason() is None
    w = packed_gemm.pack(np.ones((32, 48), np.float32).astype(jnp.bfloat16))
    jax.ffi.ffi_call("jaxbatch_packed_gemm_silu_mul", jax.ShapeDtypeStruct((4, 24), jnp.bfloat16))(
        jnp.ones((4, 32), jnp.bfloat16), jnp.asarray(w), jnp.full((1,), 4, jnp.int32))


def _norm(x, h, w):
    jax, jnp = _jnp()
    from cpu_kernels import add_rms_norm
    assert add_rms_norm.unavailable_reason() is None
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    return jax.ffi.ffi_call(add_rms_norm.TARGET, (out, out))(
        x, h, w, eps=np.float32(1e-5), offset=np.float32(0))


def n_weight_length():
    _, jnp = _jnp()
    x = jnp.ones((3, 32), jnp.bfloat16)
    _norm(x, x, jnp.ones((16,), jnp.float32))


def n_h_shape():
    _, jnp = _jnp()
    _norm(jnp.ones((3, 32), jnp.bfloat16), jnp.ones((2, 32), jnp.bfloat16),
          jnp.ones((32,), jnp.float32))


def n_no_rows():
    _, jnp = _jnp()
    x = jnp.ones((0, 32), jnp.bfloat16)
    assert _norm(x, x, jnp.ones((32,), jnp.float32))[1].shape == (0, 32)


def _argmax(x, n_out=None):
    jax, jnp = _jnp()
    from cpu_kernels import first_argmax
    assert first_argmax.unavailable_reason() is None
    out = jax.ShapeDtypeStruct((x.shape[0] if n_out is None else n_out,), jnp.int32)
    return jax.ffi.ffi_call(first_argmax.TARGET, out)(jnp.asarray(x))


def a_out_length():
    _argmax(np.zeros((3, 40), np.float32), n_out=2)


def a_empty_vocab():
    _argmax(np.zeros((3, 0), np.float32))


def a_no_rows():
    assert _argmax(np.zeros((0, 40), np.float32)).shape == (0,)


# ---- what each case must do ----------------------------------------------------------------

OK = None
EXPECTED = {
    "d_valid": OK, "d_unsorted": "sorted by row", "d_live_after_padding": "after padding",
    "d_short_list": "cover 32 keys", "d_item_arrays_disagree": "differ in items",
    "d_v_fewer_pages": "v_pages", "d_page_out_of_range": "99 outside the pool",
    "d_negative_page": "-1 outside the pool", "d_negative_slot": "slot -1",
    "d_negative_length": "length -3", "d_first_position": "first position 16",
    "d_zero_kv_heads": "must be positive", "d_zero_block_size": "must be positive",
    "d_zero_head_dim": OK, "d_empty_batch": OK,
    "d_empty_window": "one value each", "d_out_shape": "out", "d_group_too_large": "group",
    "d_wrong_dtype": "(?i)dtype|type", "d_largest_head_dim_and_group": OK,
    "d_largest_bf16": OK, "d_long_context": OK,
    "p_valid": OK, "p_zero_kv_heads": "must be positive", "p_zero_block_size": "must be positive",
    "p_page_out_of_range": "99 outside the pool", "p_position_past_table": "past its table",
    "p_bad_position": "position -5", "p_v_fewer_pages": "v_pages",
    "p_tiles_do_not_divide": "whole tiles", "p_empty_window": "one value each",
    "p_no_tokens": OK, "p_largest_head_dim_and_group": OK, "p_long_context": OK,
    "g_k_mismatch": "packed_gemm", "g_rows_shape": "rows", "g_y_shape": "y \\[4, 48\\]",
    "g_no_rows": OK, "g_no_inputs": OK, "g_silu_odd_blocks": "packed_gemm",
    "n_weight_length": "w \\[16\\]", "n_h_shape": "h \\[2, 32\\]", "n_no_rows": OK,
    "a_out_length": "out \\[2\\]", "a_empty_vocab": "V > 0", "a_no_rows": OK,
}


def _child(names):
    for name in names:
        try:
            globals()[name]()
            result = {"name": name, "raised": None}
        except Exception as e:          # noqa: BLE001 - reported to the parent
            result = {"name": name, "raised": f"{type(e).__name__}: {e}"}
        print("CASE " + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def outcomes():
    from cpu_kernels import paged_decode, paged_prefill, packed_gemm
    reason = (paged_decode.unavailable_reason() or paged_prefill.unavailable_reason()
              or packed_gemm.unavailable_reason())
    if reason:
        pytest.skip(f"CPU kernel unavailable: {reason}")
    left, results = list(EXPECTED), {}
    # the child imports what this process imports (this worktree's cpu_kernels, tests/helpers)
    import cpu_kernels
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(cpu_kernels.__file__)), ROOT, HERE,
         *[p for p in sys.path if p]]))
    while left:
        done = subprocess.run([sys.executable, __file__, *left], capture_output=True,
                              text=True, env=env, timeout=900)
        for line in done.stdout.splitlines():
            if line.startswith("CASE "):
                result = json.loads(line[5:])
                results[result["name"]] = result
        left = [n for n in left if n not in results]
        if left and done.returncode != 0:       # the first unreported case took the child down
            results[left[0]] = {"name": left[0], "crashed": done.returncode,
                                "stderr": done.stderr[-1500:]}
            left = left[1:]
        elif left:
            raise AssertionError(f"child ended without reporting {left}: {done.stderr[-1500:]}")
    return results


@pytest.mark.parametrize("name", list(EXPECTED))
def test_case(outcomes, name):
    import re
    result = outcomes[name]
    assert "crashed" not in result, (f"{name} crashed the process (exit {result['crashed']}): "
                                     f"{result['stderr']}")
    expected = EXPECTED[name]
    if expected is OK:
        assert result["raised"] is None, f"{name} should compute, raised {result['raised']}"
    else:
        assert result["raised"] is not None, f"{name} should raise, returned normally"
        assert re.search(expected, result["raised"]), result["raised"]


if __name__ == "__main__":
    import jax
    # A handler's error then reaches the call that dispatched it, not a later read of the result.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    _child(sys.argv[1:])
