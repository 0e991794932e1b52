"""The dtype policy, in one place: what each weight, matmul, norm and KV page is computed in.

    weights       the model dtype (float32, or bfloat16 where the silicon has it: `auto_dtype`);
                  on CPU each layer's matrices kept apart and transposed (`to_storage`), then
                  packed for our GEMM kernel where it runs (`storage.py`, `PACKED`)
    matmuls       inputs in the weight's dtype, accumulated in float32 (`dense`, `logits`):
                  bf16 x bf16 -> f32 is the dot XLA:CPU runs on AMX / AVX512-BF16 (1.6-3.7x
                  a float32 dot here); a bf16 x bf16 -> bf16 dot is instead rewritten by
                  XLA:CPU into a float32 dot over a float32 copy of the weight (for a stacked
                  layer weight that copy is hoisted out of the layer loop: the whole model
                  converted every step), 3x slower than either
    activations   the model dtype between matmuls (as Hugging Face's bf16 forward); norms,
                  RoPE, softmax and attention scores in float32 (model/llama.py, the kernels);
                  a bf16 pool's attention dots are bf16 x bf16 -> f32: q.K and p.V in the
                  Pallas kernels; on CPU (xla backend) q.K, and p.V in prefill only
    logits        float32, straight out of the f32 accumulator (never rounded to bf16)
    KV pages      the model dtype; on CPU a bf16 pool is stored as its raw 16-bit patterns
                  (`kv_pool_dtype`): XLA:CPU has no bf16 scatter/gather and wraps each one in
                  converts of its whole operand, which for the pool (a loop carry holding
                  every layer) meant converting ~0.4 GB to f32 and back for every layer of
                  every step (a 4-row decode step took 8 s instead of 41 ms). Integer
                  scatters and gathers are native and in place; the kernels bitcast what they
                  gather (`pallas_kernels/reference.py`: `to_pool_dtype`, `pages_as_float`).
    sampling      float32 (worker/sampler.py takes the f32 logits)
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import packed_gemm
from pallas_kernels.reference import BF16_BITS

ACCUMULATE = jnp.float32
HALF_DTYPES = ("bfloat16", "float16")


# A per-layer matrix stored transposed, {OUT_IN: w [out, in]} (`to_storage`, CPU only).
OUT_IN = "out_in"
# A matrix packed for `cpu_kernels.packed_gemm`, {PACKED: its packed array} (`storage.py`).
PACKED = "packed"
# Beside PACKED, inside one traced call: the int32 count of the call's rows up to its last
# real one (`with_rows`; padding between real rows counts); the GEMM computes no row past it.
ROWS = "rows"
# The params key of a tied LM head's packed copy (`storage.py`).
TIED_HEAD = "tied_head"


def dense(x, w):
    """x [T, in] @ w [in, out] -> [T, out] in x's dtype: x cast to w's dtype, accumulated in
    float32 (for float32 weights this is the plain float32 dot). A uint16 `w` is a slice of a
    stacked layer matrix kept as bf16 bits; {OUT_IN: w [out, in]} a per-layer matrix stored
    transposed (both `to_storage`); {PACKED: ..} one packed for our CPU GEMM kernel."""
    if is_packed(w):
        return packed_gemm.matmul(x, w[PACKED], out_dtype=x.dtype, rows=w.get(ROWS))
    if is_out_in(w):
        w = w[OUT_IN]
        return jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=ACCUMULATE).astype(x.dtype)
    w = as_float(w)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=ACCUMULATE).astype(x.dtype)


def silu_mul(x, w):
    """`packed_gemm.silu_mul` over a packed [gate | up] matrix."""
    return packed_gemm.silu_mul(x, w[PACKED], rows=w.get(ROWS))


def with_rows(matrices: dict, rows) -> dict:
    """{name: tuple of per-layer matrices} with each packed one carrying `rows`, the call's
    tokens before its padding (an int32 scalar, traced): our GEMM leaves the padding rows out
    (zeros), and a padding row's output is never read. Other forms compute every row."""
    return {name: tuple({**w, ROWS: rows} if is_packed(w) else w for w in ws)
            for name, ws in matrices.items()}


def is_out_in(w) -> bool:
    return isinstance(w, dict) and OUT_IN in w


def is_packed(w) -> bool:
    return isinstance(w, dict) and PACKED in w


def out_in(w) -> dict:
    """A per-layer float matrix in `{OUT_IN: [out, in]}` form, whichever form it is in."""
    return {OUT_IN: _transposed(as_float(w))} if is_packed(w) else w


def matrices_per_layer_default(platform: str | None = None) -> bool:
    """Whether `decoder.stack_layers` keeps each layer's matrices apart (a tuple of L arrays)
    instead of stacked [L, in, out]: on CPU, where the layer scan would copy every stacked
    slice before its dot (XLA:CPU's dot fusions cannot read a dynamic slice in place).
    JAXBATCH_WEIGHT_LAYOUT=per_layer / stacked overrides."""
    forced = os.environ.get("JAXBATCH_WEIGHT_LAYOUT")
    if forced in ("per_layer", "stacked"):
        return forced == "per_layer"
    return (platform or jax.default_backend()) == "cpu"


def to_storage(params: dict, platform: str | None = None) -> dict:
    """The layer matrices in the form XLA:CPU's dots read best (elsewhere: unchanged).

    Stacked bf16 matrices ([L, in, out], `decoder.stack_layers`) are kept as their bits
    (uint16): the layer scan slices layer l out of each stack (a dynamic-slice), which XLA:CPU
    does not do in bf16: it converts the whole stack to float32 for the slice and hoists that
    out of the loop, i.e. a float32 copy of every layer weight each step (a 30-layer MLP scan:
    550 ms against 20 ms on the bits).

    Per-layer float matrices (a tuple of L [in, out] arrays) are stored transposed,
    {OUT_IN: [out, in]} (`out_in`): the operand layout of XNNPACK's fully-connected kernels,
    which XLA:CPU's dot fusions call, so a small-batch dot reads the weight where it lies
    instead of repacking it on every call (docs/BENCHMARKS.md, 2026-12-03). `fused.py`
    then fuses q, k, v and gate, up.

    Numpy arrays are viewed or transposed on the host, device arrays once here. Idempotent;
    anything else (vectors, int8 matrices, expert stacks) passes unchanged."""
    platform = platform or jax.default_backend()
    layers = params.get("layers")
    if platform != "cpu" or not isinstance(layers, dict):
        return params

    def bits(a):
        if getattr(a, "ndim", 0) != 3 or a.dtype != jnp.bfloat16:
            return a
        if isinstance(a, np.ndarray):
            return a.view(np.uint16)
        return jax.lax.bitcast_convert_type(a, BF16_BITS)

    def per_layer(a):
        is_float = getattr(a, "ndim", 0) == 2 and jnp.issubdtype(a.dtype, jnp.floating)
        return {OUT_IN: _transposed(a)} if is_float else a

    return {**params, "layers": {k: tuple(map(per_layer, v)) if isinstance(v, tuple) else bits(v)
                                 for k, v in layers.items()}}


def _transposed(a):
    return np.ascontiguousarray(a.T) if isinstance(a, np.ndarray) else jnp.transpose(a)


def as_float(a):
    """A weight in `to_storage` form -> its [.., in, out] float values (numpy: a free view;
    a packed matrix is unpacked); others as they are."""
    if is_packed(a):
        return packed_gemm.unpack(a[PACKED])
    if is_out_in(a):
        return a[OUT_IN].T
    if a.dtype != BF16_BITS:
        return a
    if isinstance(a, np.ndarray):
        return a.view(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16)


def in_out_shape(w) -> tuple[int, int]:
    """(in, out) of a float layer matrix or one layer of it, in any `to_storage` form."""
    if is_packed(w):
        return packed_gemm.in_out_shape(w[PACKED])
    if is_out_in(w):
        return tuple(w[OUT_IN].shape[::-1])
    return tuple(w.shape[-2:])


def logical_dtype(a) -> str:
    """The dtype a params leaf holds, by name (bf16 for `to_storage`'s bits)."""
    return "bfloat16" if a.dtype == BF16_BITS else jnp.dtype(a.dtype).name


def logits(params, hidden, rows=None):
    """hidden [N, d] -> float32 logits [N, V], from `lm_head` [d, V] or the tied `embed` [V, d].
    The tied case contracts the embedding's d axis in place (dot_general), never a transposed
    copy of the [V, d] table. A packed head (`storage.py`: `lm_head`, or `TIED_HEAD` beside a
    tied embedding) is our kernel's; `rows` as in `with_rows`."""
    for key in (TIED_HEAD, "lm_head"):
        if is_packed(params.get(key)):
            return packed_gemm.matmul(hidden, params[key][PACKED], rows=rows)
    if "lm_head" in params:
        w = params["lm_head"]
        return jnp.dot(hidden.astype(w.dtype), w, preferred_element_type=ACCUMULATE)
    w = params["embed"]
    return jax.lax.dot_general(hidden.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                               preferred_element_type=ACCUMULATE)


def kv_pool_dtype(dtype, backend: str, platform: str | None = None):
    """The dtype the KV pages are stored in for a model in `dtype`: bf16's bit patterns
    (uint16) for the plain-jnp backends on CPU (see the module doc), `dtype` elsewhere (the
    Pallas kernels and GPUs handle bf16 natively)."""
    platform = platform or jax.default_backend()
    if (jnp.dtype(dtype) == jnp.bfloat16 and platform == "cpu"
            and backend in ("xla", "reference")):
        return BF16_BITS
    return jnp.dtype(dtype)


def logical_kv_dtype(storage_dtype) -> str:
    """What a pool stored in `storage_dtype` holds, by name ("bfloat16" for its bit patterns)."""
    return "bfloat16" if jnp.dtype(storage_dtype) == BF16_BITS else jnp.dtype(storage_dtype).name


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 on this host's CPU (Linux /proc/cpuinfo; False where unreadable).
    JAXBATCH_CPU_BF16=0/1 overrides (tests, or hosts that hide their flags)."""
    forced = os.environ.get("JAXBATCH_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def auto_dtype(checkpoint_dtype: str | None, platform: str | None = None) -> str:
    """dtype="auto": a 16-bit checkpoint runs in bfloat16 on accelerators and on CPUs with
    native bf16 dots, float32 elsewhere (emulated bf16 is slower than float32); a float32
    checkpoint stays float32."""
    platform = platform or jax.default_backend()
    if checkpoint_dtype not in HALF_DTYPES:
        return "float32"
    if platform == "cpu" and not cpu_has_native_bf16():
        return "float32"
    return "bfloat16"


def checkpoint_dtype(source: str, hf_config: dict) -> str | None:
    """The float dtype a checkpoint was published in. A GGUF file's converted config says
    float32 (we convert it so), so its own file type decides: all-F32 -> float32, F16 ->
    float16, anything else (BF16, or quantized blocks, whose scales are 16-bit: SmolLM2's
    embedded Q4_1 file) -> bfloat16."""
    if source.endswith(".gguf"):
        return _gguf_dtype(source)
    return hf_config.get("torch_dtype") or hf_config.get("dtype")


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@functools.lru_cache(maxsize=8)
def _gguf_dtype(path: str) -> str:
    """Reads `general.file_type` from the GGUF header itself: gguf.GGUFReader indexes every
    tensor and took 4.8 s on the embedded file, this reads a few hundred bytes."""
    import struct
    file_type = None
    with open(path, "rb") as f:
        read = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I"), read("Q")                                    # version, tensor count
        for _ in range(read("Q")):                              # key-value pairs
            key = f.read(read("Q")).decode("utf-8", "replace")
            kind = read("I")
            if key == "general.file_type" and kind in (4, 5):
                file_type = read("I")
                break
            _skip_gguf_value(f, kind, read)
    return {0: "float32", 1: "float16"}.get(file_type, "bfloat16")


def _skip_gguf_value(f, kind: int, read) -> None:
    if kind == 8:                                               # string
        f.seek(read("Q"), 1)
    elif kind == 9:                                             # array: item type, count
        item, count = read("I"), read("Q")
        if item in _GGUF_SCALAR_BYTES:
            f.seek(_GGUF_SCALAR_BYTES[item] * count, 1)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item, read)
    else:
        f.seek(_GGUF_SCALAR_BYTES[kind], 1)
