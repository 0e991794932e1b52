"""The residual add and the RMSNorm after it, for bf16 activations on CPU (`add_rms_norm.cc`).
Its reference is `jaxbatch.model.layers.add_rms_norm`'s jnp form: the same sums, and norms
within a bf16 step (the kernel takes IEEE sqrt and division where XLA:CPU approximates).

    unavailable_reason()    None where the kernel runs on this machine, else why not
    add_rms_norm(x, h, weight, eps, offset)
                            x, h [T, d] bf16, weight [d] -> (x + h, its RMSNorm), both bf16
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import availability

SOURCE = "add_rms_norm.cc"
SYMBOL, TARGET = "JaxbatchAddRmsNorm", "jaxbatch_add_rms_norm"
TARGETS = (TARGET,)


def unavailable_reason() -> str | None:
    return availability.unavailable_reason(SOURCE, SYMBOL, TARGET)


def add_rms_norm(x, h, weight, eps: float, offset: float = 0.0):
    if x.dtype != jnp.bfloat16 or h.dtype != x.dtype or x.ndim != 2 or h.shape != x.shape \
            or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: bf16 x, h [T, d] and weight [d] expected, got "
                         f"{x.dtype} {x.shape}, {h.dtype} {h.shape}, {weight.shape}")
    availability.require(SOURCE, SYMBOL, TARGET, "add_rms_norm")
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    return jax.ffi.ffi_call(TARGET, (out, out))(
        x, h, weight.astype(jnp.float32), eps=np.float32(eps), offset=np.float32(offset))
