"""int8 weight-only quantization (`quantization="int8"`).

Symmetric, one float32 scale per output channel, computed at load time from the full-precision
checkpoint (no calibration data). A quantized matrix [in, out] (or stacked [L, in, out]) becomes
{"int8": int8 [.., in, out], "scale": float32 [.., out]}.

What is quantized: the seven matrices of every decoder layer (wq, wk, wv, wo, w_gate, w_up,
w_down; for MoE families the three expert stacks in place of the MLP, one scale per expert and
output channel),
which hold ~80 % of SmolLM2-135M's weights and all of a large model's. What stays in
full precision: the token embedding and the LM head (tied to it in SmolLM2; one [V, d] matrix
that the error of every logit would pass through), the RMSNorm weights and the biases (vectors,
negligible bytes).

The matmul converts the int8 weight to the activation's dtype, accumulates in float32 and applies
the scale to the [tokens, out] result, not to the weight: XLA:GPU fuses the convert into the
GEMM's operand load, so the weight crosses memory as int8. XLA:CPU does not fuse it and
materialises the converted weight every step, which makes int8 weights slower there (measured
in docs/BENCHMARKS.md); the feature is for accelerators, where decode is bandwidth-bound.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxbatch.model.linear import Int8, Linear, PerLayer
from pallas_kernels.int8 import quantize_int8

QUANTIZATIONS = (None, "int8", "w8a8")
QUANTIZED_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                      "we_gate", "we_up", "we_down")     # the last three: MoE experts


def check_quantization(quantization) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; choose None, 'int8' (int8 "
                         "weight-only, one scale per output channel) or 'w8a8' (the same "
                         "weights against int8 activations)")


def int8_weights(quantization) -> bool:
    """Whether `quantization` stores the layer matrices as int8 (both modes do: w8a8 differs
    only in how the kernel seam multiplies them, `worker/weight_forms.py`)."""
    return quantization in ("int8", "w8a8")


def is_quantized(weight) -> bool:
    return isinstance(weight, dict) and "int8" in weight


def quantize_matrix(weight) -> dict:
    """[.., in, out] float -> {"int8": [.., in, out] int8, "scale": [.., out] float32}."""
    values, scale = quantize_int8(weight, axis=-2)
    return {"int8": values, "scale": scale}


def dequantize_matrix(weight: dict, dtype=jnp.float32):
    return (weight["int8"].astype(jnp.float32) * weight["scale"][..., None, :]).astype(dtype)


def _quantize_entry(weight):
    if isinstance(weight, tuple):                   # per-layer layout: one matrix per layer
        return tuple(_quantize_entry(w) for w in weight)
    if isinstance(weight, Linear):                  # a typed weight: its float values
        weight = weight.to_float()
    return weight if is_quantized(weight) else quantize_matrix(weight)


def quantize_params(params: dict) -> dict:
    """A new params dict with the layer matrices int8 (idempotent: quantized ones are kept).
    Accepts the loader's list of per-layer dicts and the stacked layers dict alike; numpy
    arrays stay numpy (host-side quantization before the device copy). Takes plain params
    (before `worker/weight_forms.py` gives the matrices their form)."""
    layers = params["layers"]
    if isinstance(layers, list):
        layers = [{name: _quantize_entry(w) if name in QUANTIZED_MATRICES else w
                   for name, w in layer.items()} for layer in layers]
    else:
        layers = {name: _quantize_entry(w) if name in QUANTIZED_MATRICES else w
                  for name, w in layers.items()}
    return {**params, "layers": layers}


def params_are_quantized(params: dict) -> bool:
    layers = params["layers"]
    layer = layers[0] if isinstance(layers, list) else layers
    weight = layer["wo"]                            # never fused
    if isinstance(weight, PerLayer):
        weight = weight.layers
    weight = weight[0] if isinstance(weight, tuple) else weight
    return is_quantized(weight) or isinstance(weight, Int8)
