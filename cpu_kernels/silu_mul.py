"""The gated MLP's activation product on CPU (`silu_mul.cc`): silu(gate) * up over the fused
gate/up matmul's bf16 output, whose reference is `jaxbatch.model.layers.activation(gate,
"silu") * up` (XLA:CPU ran that elementwise product far slower than the bytes it moves).

    unavailable_reason()   None where the kernel runs on this machine, else why not
    why_not(dtype)         None where it covers activations of `dtype` here (bf16 only: the
                           float32 path stays XLA's, exact against Hugging Face)
    silu_mul(gate_up [T, 2 I])  -> [T, I] bf16
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import availability

SOURCE = "silu_mul.cc"
SYMBOL, TARGET = "JaxbatchSiluMul", "jaxbatch_silu_mul"
TARGETS = (TARGET,)


def unavailable_reason() -> str | None:
    return availability.unavailable_reason(SOURCE, SYMBOL, TARGET)


def why_not(dtype) -> str | None:
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"{jnp.dtype(dtype).name} activations, not bf16"
    return unavailable_reason()


def silu_mul(gate_up):
    if gate_up.dtype != jnp.bfloat16 or gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: bf16 gate_up [T, 2 I] expected, got {gate_up.dtype} "
                         f"{gate_up.shape}")
    reason = availability.register(SOURCE, SYMBOL, TARGET)
    if reason:
        raise RuntimeError(f"silu_mul cannot run here: {reason}")
    out = jax.ShapeDtypeStruct((gate_up.shape[0], gate_up.shape[1] // 2), jnp.bfloat16)
    return jax.ffi.ffi_call(TARGET, out)(gate_up)
