"""The CPU GEMM kernels over packed weights (`cpu_kernels/packed_gemm.cc`, bf16 and float32)
against their reference, `jnp.dot(x, w, preferred_element_type=float32)`; the packing; and
the engine's storage of its matrices. Skipped, with the reason, where the kernel cannot run
(no AVX512-BF16, no g++)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import packed_gemm
from jaxbatch.worker.kernel_forms import SILU_EPILOGUE_MIN_ROWS

REASON = packed_gemm.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

_kernel = jax.jit(packed_gemm.matmul)


@jax.jit
def _reference(x, w):
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _case(seed, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32).astype(dtype)
    w = rng.standard_normal((k, n)).astype(np.float32).astype(dtype)
    return x, w


SHAPES = [
    # (m, k, n): rows past a register tile of 8, column blocks 1, 2 and 3 in the last unit
    (1, 2, 16), (3, 30, 32), (8, 64, 48), (9, 576, 64), (17, 96, 80), (40, 1536, 576),
    (5, 576, 960),
    (4, 4096, 112),     # one row tile whose panels would crowd L2: it streams its own
]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_its_reference(m, k, n, dtype):
    x, w = _case(m * 1000 + n, m, k, n, dtype)
    out = _kernel(jnp.asarray(x), jnp.asarray(packed_gemm.pack(w)))
    ref = _reference(jnp.asarray(x), jnp.asarray(w))
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    # bf16 products are exact in float32; only the rounding of the float32 sums may differ:
    # a few ulps per term of sum |x w|
    magnitude = np.abs(x.astype(np.float32)) @ np.abs(w.astype(np.float32))
    bound = 4 * k * np.finfo(np.float32).eps * magnitude
    assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= bound)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pack_and_unpack_are_inverse_and_put_each_value_where_the_kernel_reads_it(dtype):
    _, w = _case(3, 1, 6, 32, dtype)
    packed = packed_gemm.pack(w)
    per_step = 2 if dtype == jnp.bfloat16 else 1
    assert packed.shape == (2, 6 // per_step, 16 * per_step)
    assert packed_gemm.in_out_shape(packed) == (6, 32)
    # element [b, p, s j + t] = w[s p + t, 16 b + j]
    b, p, j, t = 1, 2, 5, per_step - 1
    assert packed.view(w.dtype)[b, p, per_step * j + t] == w[per_step * p + t, 16 * b + j]
    np.testing.assert_array_equal(packed_gemm.unpack(packed), w)
    np.testing.assert_array_equal(np.asarray(packed_gemm.unpack(jnp.asarray(packed))), w)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    x, w = _case(11, 37, 576, 240, dtype)
    packed = jnp.asarray(packed_gemm.pack(w))
    batch = np.asarray(_kernel(jnp.asarray(x), packed))
    for start, rows in ((0, 1), (13, 1), (5, 8), (30, 7), (0, 16)):
        part = np.asarray(_kernel(jnp.asarray(x[start:start + rows]), packed))
        np.testing.assert_array_equal(part, batch[start:start + rows])


@pytest.mark.parametrize("m,k,n", [(3, 30, 32), (9, 576, 64), (40, 1536, 576)])
def test_bf16_out_is_the_float32_result_rounded(m, k, n):
    """out_dtype bf16: the kernel rounds each float32 result to nearest even, exactly what
    `.astype(bfloat16)` on the float32 result gives (bit for bit)."""
    x, w = _case(7 * m + n, m, k, n, jnp.bfloat16)
    packed = jnp.asarray(packed_gemm.pack(w))
    out = jax.jit(packed_gemm.matmul, static_argnums=2)(jnp.asarray(x), packed, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    rounded = _kernel(jnp.asarray(x), packed).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  np.asarray(rounded).view(np.uint16))


def _silu_mul_reference(x, packed):
    """What the model computes without the epilogue: the bf16 GEMM, split, then
    `layers.activation` times up."""
    from jaxbatch.model.linear import activation
    gate, up = jnp.split(packed_gemm.matmul(x, packed, jnp.bfloat16), 2, axis=-1)
    return activation(gate, "silu") * up


@pytest.mark.parametrize("m,k,i", [(1, 2, 16), (3, 30, 32), (9, 576, 48), (37, 576, 1536),
                                   (64, 128, 80)])
def test_silu_mul_is_the_activation_of_the_bf16_gemm_bit_for_bit(m, k, i):
    """Gate and up rounded to bf16, silu in float32, both products rounded as the model's jnp
    rounds them: the same bits, over gates of a few units to a few hundred (where e^-g
    overflows and the sigmoid is 0)."""
    x, w = _case(3 * m + i, m, k, 2 * i, jnp.bfloat16)
    x = (x.astype(np.float32) * 4).astype(jnp.bfloat16)
    packed = jnp.asarray(packed_gemm.pack(w))
    out = jax.jit(packed_gemm.silu_mul)(jnp.asarray(x), packed)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, i)
    ref = jax.jit(_silu_mul_reference)(jnp.asarray(x), packed)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref).view(np.uint16))


@pytest.mark.parametrize("m,rows", [(9, 0), (9, 1), (9, 8), (17, 9), (16, 16), (5, 7), (40, 33),
                                    (6, -3)])
def test_rows_past_the_count_are_zeros_and_the_others_as_computed_whole(m, rows):
    """`rows`: a call's padding after its real tokens is not computed (zeros, whatever it
    holds: NaN here), and no real row changes (one row tile or several, every handler); a
    count past M computes every row, a negative one none."""
    kept = min(max(rows, 0), m)
    x, w = _case(m + 7 * abs(rows), m, 576, 96, jnp.bfloat16)
    x[kept:] = np.nan
    x, packed = jnp.asarray(x), jnp.asarray(packed_gemm.pack(w))
    x32, w32 = _case(abs(rows), m, 96, 48, jnp.float32)
    x32[kept:] = np.nan
    x32, packed32 = jnp.asarray(x32), jnp.asarray(packed_gemm.pack(w32))
    cases = [(packed_gemm.matmul, x, packed), (packed_gemm.silu_mul, x, packed),
             (lambda x, w, rows=None: packed_gemm.matmul(x, w, jnp.bfloat16, rows=rows), x, packed),
             (packed_gemm.matmul, x32, packed32)]
    for fn, a, b in cases:
        whole = np.asarray(jax.jit(fn)(a, b))
        part = np.asarray(jax.jit(lambda a, b, n: fn(a, b, rows=n))(a, b, jnp.int32(rows)))
        assert part.shape == whole.shape
        np.testing.assert_array_equal(part[:kept], whole[:kept])
        assert not part[kept:].any()


def test_silu_mul_refuses_what_it_does_not_cover():
    _, w = _case(1, 1, 4, 48, jnp.bfloat16)             # 3 column blocks: no gate/up halves
    assert "column blocks" in packed_gemm.silu_mul_why_not(packed_gemm.pack(w))
    _, w32 = _case(1, 1, 4, 32, jnp.float32)
    assert "float32" in packed_gemm.silu_mul_why_not(packed_gemm.pack(w32))
    with pytest.raises(RuntimeError, match="silu_mul cannot run"):
        packed_gemm.silu_mul(jnp.zeros((2, 4), jnp.bfloat16), jnp.asarray(packed_gemm.pack(w)))


def test_leading_axes_and_the_input_dtype():
    x, w = _case(5, 6, 32, 16, jnp.bfloat16)
    packed = jnp.asarray(packed_gemm.pack(w))
    x3 = jnp.asarray(x, jnp.float32).reshape(2, 3, 32)       # cast to the weight's dtype
    out = _kernel(x3, packed)
    assert out.shape == (2, 3, 16)
    np.testing.assert_array_equal(np.asarray(out).reshape(6, 16),
                                  np.asarray(_kernel(jnp.asarray(x), packed)))


def test_refuses_what_it_does_not_cover():
    assert packed_gemm.why_not(jnp.bfloat16, 576, 960) is None
    assert packed_gemm.why_not(jnp.float32, 7, 16) is None          # odd in: one k a step
    assert "multiple" in packed_gemm.why_not(jnp.bfloat16, 7, 16)   # bf16 takes pairs of k
    assert "multiple" in packed_gemm.why_not(jnp.float32, 8, 40)
    assert "neither" in packed_gemm.why_not(jnp.int8, 8, 16)
    assert "neither" in packed_gemm.why_not(jnp.float16, 8, 16)
    with pytest.raises(ValueError, match=r"x \[\.\., 8\] expected"):
        packed_gemm.matmul(jnp.zeros((2, 6), jnp.bfloat16),
                           jnp.asarray(packed_gemm.pack(np.zeros((8, 16), jnp.bfloat16))))


def test_the_option_turns_it_off():
    from engines import tiny_engine_in
    engine = tiny_engine_in(jnp.bfloat16, cpu_kernels="off")
    assert "cpu_kernels='off'" in engine.stats()["kernels"]["matmul"]
    assert engine.stats()["matmuls"] == "XLA dots"


def test_the_switch_turns_it_off(request):
    import cpu_kernels
    cpu_kernels.configure(mode="off")
    request.addfinalizer(cpu_kernels.configure)
    assert "turned off" in packed_gemm.why_not(jnp.bfloat16, 576, 960)


def _compiled_texts(engine):
    """{key: compiled text} of the largest decode and prefill calls, and of the smallest
    prefill call when that one is under SILU_EPILOGUE_MIN_ROWS tokens."""
    runner = engine.runner
    keys = runner.layout.bucket_shapes()
    prefills = [k for k in keys if k[0] == "prefill"]
    keys = [[k for k in keys if k[0] == "decode"][-1], prefills[-1], prefills[0]]
    return {k: runner.executables.lower(k, runner.example_args(k)).compile().as_text()
            for k in keys}


# greedy tokens of 40 that must agree before a divergence: the kernel sums in XLA's order here,
# but a bf16 tie broken by one float32 ulp may flip a token
AGREE = {jnp.bfloat16: 36, jnp.float32: 40}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_engine_runs_its_matmuls_on_the_kernel_and_agrees_with_xla(monkeypatch, dtype):
    from engines import greedy_case, run_all, tiny_engine_in, tokens_agreeing
    from jaxbatch.worker import kernels
    # Only the GEMM differs between the two engines: the add + norm kernel takes IEEE sqrt
    # where XLA approximates (tested in its own file), so neither engine is given it.
    monkeypatch.setattr(kernels, "_norm_reason", lambda *a: "left out by this test")
    prompts, params = greedy_case()
    target = packed_gemm.TARGETS[0 if dtype == jnp.bfloat16 else 1]
    # a bf16 model's layer matmuls round to bf16 in the kernel; the head's logits stay float32
    layer_target = packed_gemm.TARGETS[2] if dtype == jnp.bfloat16 else target
    with_kernel = tiny_engine_in(dtype)
    assert with_kernel.stats()["matmuls"] == "cpu_kernels.packed_gemm"
    layers = with_kernel.runner.model_cfg.num_layers
    texts = _compiled_texts(with_kernel)
    assert {k[1] >= SILU_EPILOGUE_MIN_ROWS for k in texts} == {True, False}
    for key, text in texts.items():                         # prefill and decode alike
        # one call per layer of each of wqkv, wo, w_gate_up and w_down, and the head's; a bf16
        # call of SILU_EPILOGUE_MIN_ROWS tokens or more takes silu * up in w_gate_up's call
        calls = {t: text.count(f'custom_call_target="{t}"') for t in packed_gemm.TARGETS}
        expected = {target: 1}
        if dtype == jnp.bfloat16 and key[1] >= SILU_EPILOGUE_MIN_ROWS:
            expected[packed_gemm.TARGETS[3]] = layers
            expected[layer_target] = expected.get(layer_target, 0) + 3 * layers
        else:
            expected[layer_target] = expected.get(layer_target, 0) + 4 * layers
        assert {t: n for t, n in calls.items() if n} == expected, (key, calls)
    outs = run_all(with_kernel, prompts, params)
    monkeypatch.setattr(packed_gemm, "why_not", lambda *a: "off")
    plain = tiny_engine_in(dtype)
    assert plain.stats()["matmuls"] == "XLA dots"
    assert all(f'"{t}"' not in text for text in _compiled_texts(plain).values()
               for t in packed_gemm.TARGETS)
    agree = tokens_agreeing(outs, run_all(plain, prompts, params), logprob_tol=1e-3)
    assert agree >= AGREE[dtype], f"only {agree} of 40 greedy tokens agree before a divergence"


def test_bench_gemm_reports_both_and_their_agreement(tmp_path, capsys):
    from benchmarks import gemm
    assert gemm.main(["--rows", "3", "--dtype", "float32", "--matrices", "wo", "--calls", "2",
                      "--out", str(tmp_path)]) == 0
    import json
    (result,) = json.loads((tmp_path / "gemm.json").read_text())["results"]
    assert (result["matrix"], result["rows"], result["in"], result["out"]) == ("wo", 3, 576, 576)
    assert result["xla_ms"] > 0 and result["kernel_ms"] > 0 and result["max_rel_diff"] < 1e-5
    assert "| float32 | wo [576, 576] | 3 |" in (tmp_path / "gemm.md").read_text()


def test_every_model_call_tells_its_layer_gemms_where_the_padding_starts(monkeypatch):
    """The runner's decode, prefill and mixed calls hand each layer GEMM the count of their
    rows before the padding (`decoder.padding_start`), and a decode call its LM head too; at
    run time the padding rows of a decode call's logits are zeros (not computed)."""
    from engines import tiny_engine_in
    from jaxbatch import SamplingParams
    from jaxbatch.worker import runner as runner_mod
    seen = []
    real_matmul, real_silu_mul = packed_gemm.matmul, packed_gemm.silu_mul

    def matmul(x, packed, out_dtype=jnp.float32, rows=None, **variant):
        # a bf16 model's layers round to bf16; its head's logits stay float32
        seen.append(("head" if jnp.dtype(out_dtype) == jnp.float32 else "layer",
                     rows is not None))
        return real_matmul(x, packed, out_dtype, rows, **variant)

    def silu_mul(x, packed, rows=None, **variant):
        seen.append(("layer", rows is not None))
        return real_silu_mul(x, packed, rows, **variant)
    monkeypatch.setattr(packed_gemm, "matmul", matmul)
    monkeypatch.setattr(packed_gemm, "silu_mul", silu_mul)
    engine = tiny_engine_in(jnp.bfloat16, unified_step=True)
    runner = engine.runner
    keys = runner.layout.bucket_shapes()
    for kind in ("decode", "prefill", "mixed"):
        key = next(k for k in keys if k[0] == kind)
        seen.clear()
        runner.executables.lower(key, runner.example_args(key))
        layers = [given for what, given in seen if what == "layer"]
        heads = [given for what, given in seen if what == "head"]
        assert layers and all(layers), (key, seen)
        assert heads == [kind == "decode"], (key, seen)

    logits_of = {}
    real_sample = runner_mod.ModelRunner._sample

    def sample(self, call, logits, hidden, bitmask_fn):
        logits_of[call.key[0]] = (len(call.decode_rows), np.asarray(logits))
        return real_sample(self, call, logits, hidden, bitmask_fn)
    monkeypatch.setattr(runner_mod.ModelRunner, "_sample", sample)
    engine.add_request("one", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    real, logits = logits_of["decode"]
    assert real == 1 and logits.shape[0] > 1
    assert logits[:real].any() and not logits[real:].any()
