"""The first maximum of each row of float32 logits, NaN as +inf, on CPU (`first_argmax.cc`).
Its reference is `jaxbatch.worker.argmax.two_level_argmax`; the result is exact.

    unavailable_reason()    None where the kernel runs on this machine, else why not
    first_argmax(x)         x [N, V] float32 -> [N] int32
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import availability

SOURCE = "first_argmax.cc"
SYMBOL, TARGET = "JaxbatchFirstArgmax", "jaxbatch_first_argmax"
TARGETS = (TARGET,)


def unavailable_reason() -> str | None:
    return availability.unavailable_reason(SOURCE, SYMBOL, TARGET)


def first_argmax(x):
    if x.dtype != jnp.float32 or x.ndim != 2:
        raise ValueError(f"first_argmax: float32 x [N, V] expected, got {x.dtype} {x.shape}")
    availability.require(SOURCE, SYMBOL, TARGET, "first_argmax")
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32),
                            vmap_method="sequential")(x)
