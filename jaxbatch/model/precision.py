"""The dtype policy, in one place: what each weight, matmul, norm and KV page is computed in.

    weights       the model dtype (float32, or bfloat16 where the silicon has it: `auto_dtype`),
                  each matrix in the form the engine's kernels read (`model/linear.py`)
    matmuls       inputs in the weight's dtype, accumulated in float32 (`linear.py`):
                  bf16 x bf16 -> f32 is the dot XLA:CPU runs on AMX / AVX512-BF16 (1.6-3.7x
                  a float32 dot here); a bf16 x bf16 -> bf16 dot is instead rewritten by
                  XLA:CPU into a float32 dot over a float32 copy of the weight (for a stacked
                  layer weight that copy is hoisted out of the layer loop: the whole model
                  converted every step), 3x slower than either
    activations   the model dtype between matmuls (as Hugging Face's bf16 forward); norms,
                  RoPE, softmax and attention scores in float32 (model/norms.py, the kernels);
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

import jax
import jax.numpy as jnp

from pallas_kernels.reference import BF16_BITS

HALF_DTYPES = ("bfloat16", "float16")


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
    A host that hides its flags is given dtype="bfloat16" explicitly."""
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
