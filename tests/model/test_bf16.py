"""bf16 end to end on XLA:CPU (issue 27): what the compiled steps contain, the dtype="auto"
policy, and batch invariance of the embedded model in bf16.

The HLO checks read the optimized module of a decode and a prefill call of a tiny bf16 engine:
every layer matmul and the LM head are bf16 x bf16 dots accumulating in float32 (XLA's dots,
or our GEMM kernel's custom calls over the packed weights: `worker/weight_forms.py`), and no
instruction produces a float32 (or, for the KV pool, a bf16) array of a weight's or the pool's
shape: XLA:CPU used to wrap bf16 scatters, gathers, dynamic-slices and bf16-output dots in
converts of their whole operand, which cost 200x on a decode step.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model import precision
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.linear import Bf16Bits, Dense, OutIn, PerLayer
from jaxbatch.worker.weight_forms import WeightForm, prepare, to_plain
from jaxbatch.model.loader import LoadedModel
from engines import tokens_and_logprobs
from tiny_models import make_hf_model, ours_from_hf

_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_OPCODE = re.compile(r"%([\w.\-]+) = \S+ ([\w\-]+)\(")
# What a weight may appear as without being copied: the executable's inputs and views of them.
_VIEWS = {"parameter", "get-tuple-element", "tuple", "bitcast"}
_DOT = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")
# x, the packed weight, then the count of rows before the padding
_GEMM = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* custom-call\("
                   r"%([\w.\-]+), %([\w.\-]+), %[\w.\-]+\)"
                   r".*custom_call_target=\"jaxbatch_packed_gemm(_bf16_out|_silu_mul)?(?:_amx)?\"")


def _bf16(loaded: LoadedModel) -> LoadedModel:
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), loaded.params)
    return LoadedModel(loaded.config, params, None, loaded.source + "-bf16", 0.0, False)


@pytest.fixture(scope="module", params=[("llama_untied_gqa2", "per_layer"),
                                        ("llama_tied_mha", "per_layer"),
                                        ("llama_untied_gqa2", "stacked")])
def tiny_bf16_engine(request):
    """Both weight layouts (model/decoder.py): per layer and transposed is CPU's default."""
    name, layout = request.param
    cfg, params = ours_from_hf(make_hf_model(name, seed=3))
    params = stack_layers(params, matrices_per_layer=layout == "per_layer")
    loaded = _bf16(LoadedModel(cfg, params, None, "tiny", 0.0, False))
    # Calls of at most 16 tokens: no activation [T, n] can share the shape of a weight, whose
    # dims are 32, 64 or 128 either way round.
    engine = LLMEngine(loaded=loaded, max_num_seqs=2, max_model_len=64, prefill_chunk_size=16,
                       warmup=False, compilation_cache=False, weight_layout=layout)
    return engine, loaded


def _shapes(text: str, materialized_only: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Instruction name -> (element type, shape). `materialized_only`: leave out the inside of
    fused computations, whose elementwise steps are never stored as arrays (a gather from the
    bf16 embedding fuses its convert per gathered element; the fusion's output is listed at
    its call site)."""
    fused = set(re.findall(r"fusion\(.*calls=%([\w.\-]+)", text))
    out, skip = {}, False
    for line in text.splitlines():
        start = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if start:
            skip = materialized_only and start[1] in fused
            continue
        m = _DEF.search(line)
        if m and not skip:
            out[m[1]] = (m[2], tuple(int(d) for d in m[3].split(",") if d))
    return out


def _layer_matrices(params) -> set[tuple[int, ...]]:
    """One layer's shape of every layer matrix, as the runner stores it (a stacked slice, or
    one array of the per-layer tuple: [in, out], transposed or packed)."""
    out = set()
    for value in params["layers"].values():
        if isinstance(value, PerLayer):
            out |= {tuple(leaf.shape) for leaf in jax.tree.leaves(value)}
        else:
            out |= {tuple(leaf.shape[-2:]) for leaf in jax.tree.leaves(value) if leaf.ndim == 3}
    return out


def _head(params) -> tuple[int, ...]:
    """The shape of the matrix the LM head reads: packed, `lm_head` or the tied `embed`."""
    for key in ("tied_head", "lm_head", "embed"):
        if key in params:
            return tuple(jax.tree.leaves(params[key])[0].shape)


def _weight_shapes(params) -> set[tuple[int, ...]]:
    """Every shape a weight matrix (or its per-layer slice) has."""
    out = {tuple(params["embed"].shape), _head(params)} | _layer_matrices(params)
    for a in jax.tree.leaves(params["layers"]):
        if a.ndim == 3:
            out |= {tuple(a.shape), (1,) + tuple(a.shape[1:])}
    return out


def test_compiled_steps_have_bf16_dots_and_no_float32_weight_or_pool_copies(tiny_bf16_engine):
    engine, loaded = tiny_bf16_engine
    runner = engine.runner
    assert engine.stats()["dtype"] == "bfloat16" and engine.stats()["kv_cache_dtype"] == "bfloat16"
    weights = _weight_shapes(runner.params)
    matrices = _layer_matrices(runner.params)
    assert len(matrices) >= 3                                   # q/o, k/v, gate/up, down
    lm_head = _head(runner.params)
    pool = tuple(runner.pool[0].shape)
    keys = runner.layout.bucket_shapes()
    model_keys = [[k for k in keys if k[0] == kind][-1] for kind in ("decode", "prefill", "mixed")]
    assert model_keys[1][1] < 64
    for key in model_keys:
        text = runner.executables.lower(key, runner.example_args(key)).compile().as_text()
        shapes = _shapes(text)
        bad = sorted({(n, s) for n, (t, s) in _shapes(text, materialized_only=True).items()
                      if (t == "f32" and (s in weights or s == pool)) or (t == "bf16" and s == pool)})
        assert not bad, (key, bad[:5])
        if isinstance(runner.params["layers"]["wo"], PerLayer):
            # Per layer, each dot reads its weight where it lies: no bf16 copy of any matrix
            # (the stacked layout copies every slice out of its stack: model/decoder.py).
            opcodes = dict(_OPCODE.findall(text))
            copies = sorted((n, opcodes.get(n)) for n, (t, s) in
                            _shapes(text, materialized_only=True).items()
                            if t in ("bf16", "u16") and s in matrices
                            and opcodes.get(n) not in _VIEWS)
            assert not copies, (key, copies[:5])
        # Dots whose weight operand is bf16, accumulated in f32: each layer matrix and the head
        # (the packed GEMM's: a bf16 x and the weight's bf16 bits, a float32 result or, from
        # its bf16-out and silu-mul handlers, bf16 rounded in the kernel from float32 sums).
        bf16_dots = set()
        for m in _DOT.finditer(text):
            operands = [shapes.get(m[4]), shapes.get(m[5])]
            if m[2] == "f32":
                bf16_dots |= {s for t, s in filter(None, operands) if t == "bf16"}
        for m in _GEMM.finditer(text):
            x, w = shapes.get(m[4]), shapes.get(m[5])
            result_ok = m[2] == "f32" or (m[2] == "bf16" and m[6])
            if result_ok and x and x[0] == "bf16" and w and w[0] == "u16":
                bf16_dots.add(w[1])
        missing = (matrices | {lm_head}) - bf16_dots
        assert not missing, (key, missing, sorted(bf16_dots))


def test_bf16_tiny_engine_matches_float32_closely(tiny_bf16_engine):
    """A sanity bound (bf16 rounding of weights and activations), not an oracle: the float32
    path is the one held exact against Hugging Face (tests/model/test_model.py)."""
    engine, loaded = tiny_bf16_engine
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    engine.add_request("bf16", prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
    # The same bf16 values, computed in float32.
    as_f32 = LoadedModel(loaded.config, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                                                     loaded.params), None, "tiny-f32", 0.0, False)
    f32 = LLMEngine(loaded=as_f32, max_num_seqs=2, max_model_len=64, prefill_chunk_size=32,
                    warmup=False, compilation_cache=False)
    f32.add_request("f32", prompt, params)
    while f32.has_unfinished_requests():
        ref = f32.step()
    want = [d[t] for d, t in zip(ref[0].prompt_logprobs[1:], prompt[1:])]
    got = [d[t] for d, t in zip(outs[0].prompt_logprobs[1:], prompt[1:])]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=0.05)


def test_storage_bits_round_trip_and_dense_reads_them():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.bfloat16)
    params = {"embed": w[0], "layers": {"wq": w, "norm": w[:, 0]}}
    cpu = WeightForm(bits=True)                         # stacked, as XLA:CPU reads them
    stored = prepare(params, cpu)
    assert isinstance(stored["layers"]["wq"], Bf16Bits)
    assert stored["layers"]["wq"].bits.dtype == jnp.uint16
    assert stored["layers"]["norm"].dtype == jnp.bfloat16 and stored["embed"].dtype == jnp.bfloat16
    assert prepare(stored, cpu)["layers"]["wq"] is stored["layers"]["wq"]
    assert isinstance(prepare(params, WeightForm())["layers"]["wq"], Dense)
    host = prepare(jax.tree.map(np.asarray, params), cpu)
    np.testing.assert_array_equal(host["layers"]["wq"].bits, np.asarray(stored["layers"]["wq"].bits))
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.bfloat16)
    layer_1 = jax.tree.map(lambda a: a[1], stored["layers"]["wq"])     # the scan's slice
    np.testing.assert_array_equal(layer_1.apply(x), Dense(w[1]).apply(x))
    assert stored["layers"]["wq"].dtype_name == "bfloat16"
    # int8 quantization of a stored stack reads its values, not its bits.
    from jaxbatch.model.quantize import quantize_matrix, quantize_params
    q = quantize_params(to_plain(stored))["layers"]["wq"]
    np.testing.assert_array_equal(q["int8"], quantize_matrix(w)["int8"])
    # float32 stays the plain float32 dot, bit for bit.
    x32, w32 = x.astype(jnp.float32), w[1].astype(jnp.float32)
    np.testing.assert_array_equal(Dense(w32).apply(x32), x32 @ w32)


def test_auto_dtype_follows_the_checkpoint_where_bf16_is_native(monkeypatch):
    from jaxbatch.model.loader import embedded_gguf_path, resolve_dtype
    assert precision.checkpoint_dtype(embedded_gguf_path(), {"dtype": "float32"}) == "bfloat16"
    assert precision.checkpoint_dtype("/x/dir", {"torch_dtype": "float16"}) == "float16"
    for native, cpu in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
        assert precision.auto_dtype("bfloat16", platform="cpu") == cpu
        assert precision.auto_dtype("bfloat16", platform="gpu") == "bfloat16"
        assert precision.auto_dtype("float32", platform="gpu") == "float32"
        assert precision.auto_dtype(None, platform="gpu") == "float32"
    monkeypatch.undo()
    flags = open("/proc/cpuinfo").read()
    native = "amx_bf16" in flags or "avx512_bf16" in flags
    assert precision.cpu_has_native_bf16() == native
    if jax.default_backend() == "cpu":
        assert resolve_dtype("auto", "bfloat16") == ("bfloat16" if native else "float32")
    assert resolve_dtype("float32", "bfloat16") == "float32"


@pytest.fixture(scope="module")
def embedded_bf16():
    from jaxbatch.model.loader import load_model
    return load_model(dtype="bfloat16")


def test_embedded_bf16_outputs_are_identical_solo_and_in_a_batch(embedded_bf16):
    """Bit for bit: every generated token's logprob is the same alone, in pairs and in a batch
    of four. XLA:CPU's dot sums in another order for 1 or 2 rows than for 3 or more (a bf16
    activation then rounds the other way), so decode calls have at least 4 rows
    (`step_inputs.MIN_DECODE_ROWS`); with 1-row calls the solo logprobs differ."""
    from jaxbatch import LLM
    llm = LLM(loaded=embedded_bf16, max_num_seqs=4, max_model_len=256)
    stats = llm.llm_engine.stats()
    assert stats["dtype"] == "bfloat16" and stats["kv_cache_dtype"] == "bfloat16"
    prompts = ["The capital of France is", "Write a haiku about rain.",
               "List three prime numbers:", "Once upon a time, in a small village,"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True,
                             logprobs=0)]

    def run(group):
        return tokens_and_logprobs(llm, prompts, params, group)

    batch = run([0, 1, 2, 3])
    pairs = {**run([0, 1]), **run([2, 3])}
    solo = {i: run([i])[i] for i in range(4)}
    assert batch == solo
    assert batch == pairs
    assert len({tuple(toks) for toks, _ in batch.values()}) == len(prompts)
    stats = llm.llm_engine.stats()
    assert stats["num_compilations_after_warmup"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_per_layer_matrices_are_stored_transposed_and_restack_to_the_same_values():
    rng = np.random.default_rng(1)
    w = [jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16) for _ in range(2)]
    norm = jnp.ones((2, 8), jnp.bfloat16)
    params = {"embed": w[0], "layers": {"wq": tuple(w), "norm": norm}}
    cpu = WeightForm(per_layer=True, transposed=True)
    stored = prepare(params, cpu)
    assert all(isinstance(m, OutIn) and m.w.shape == (4, 8) for m in stored["layers"]["wq"].layers)
    assert stored["layers"]["norm"] is norm
    assert prepare(stored, cpu)["layers"]["wq"] is stored["layers"]["wq"]
    assert not isinstance(prepare(params, WeightForm(per_layer=True))["layers"]["wq"].layers[0],
                          OutIn)
    assert stored["layers"]["wq"].layers[1].in_out == (8, 4)
    host = prepare(jax.tree.map(np.asarray, params), cpu)
    np.testing.assert_array_equal(host["layers"]["wq"].layers[1].w, np.asarray(w[1]).T)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.standard_normal((5, 8)), dtype)
        got = prepare({"layers": {"wq": (w[1].astype(dtype),)}, "embed": w[0]},
                      cpu)["layers"]["wq"].layers[0].apply(x)
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(Dense(w[1].astype(dtype)).apply(x), np.float32),
                                   rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    # Tensor parallelism's stacked [L, in, out] from the stored form, values unchanged.
    restacked = prepare(stored, WeightForm())["layers"]["wq"].to_float()
    np.testing.assert_array_equal(np.asarray(restacked), np.stack([np.asarray(m) for m in w]))
    from jaxbatch.model.quantize import quantize_matrix, quantize_params
    q = quantize_params(to_plain(stored))["layers"]["wq"][1]
    np.testing.assert_array_equal(q["int8"], quantize_matrix(w[1])["int8"])
