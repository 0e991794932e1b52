"""The weights in the form the platform's matmuls read best, in one call: `prepare`.

On CPU, in order:
  1. `precision.to_storage`: each layer's matrices kept apart and transposed ({OUT_IN}); bf16
     stacks as their bits;
  2. `fused.fuse_params`: q/k/v and gate/up fused into one matrix per layer;
  3. `pack`: every per-layer float matrix, and the LM head (tied or not), packed once for our
     GEMM kernel (`cpu_kernels.packed_gemm`, {PACKED}) where it covers them. XLA:CPU's dots of
     a few rows run far under the machine's bf16 and float32 rates; the kernel reads each
     packed weight once per call at close to them (docs/BENCHMARKS.md). A tied head costs a
     packed copy of the embedding: the table itself stays for the token lookup.
Elsewhere (GPUs; stacked layouts, as tensor parallelism uses) the params pass unchanged. Every
step is idempotent, so the loader and the runner may both call `prepare`.
"""
from __future__ import annotations

import jax
import numpy as np

from cpu_kernels import packed_gemm
from jaxbatch.model import fused, precision

# The packed copy of a tied LM head ([d, V] from the [V, d] embedding), beside the embedding.
TIED_HEAD = precision.TIED_HEAD


def prepare(params: dict, platform: str | None = None) -> dict:
    platform = platform or jax.default_backend()
    return pack(fused.fuse_params(precision.to_storage(params, platform)), platform)


def pack(params: dict, platform: str | None = None) -> dict:
    """Per-layer {OUT_IN} float matrices and the LM head -> {PACKED}, where the kernel covers
    them on this machine (`packed_gemm.why_not`); all else unchanged."""
    layers = params.get("layers")
    if (platform or jax.default_backend()) != "cpu" or not isinstance(layers, dict):
        return params
    per_layer = {k: v for k, v in layers.items()
                 if isinstance(v, tuple) and all(precision.is_out_in(w) for w in v)}
    if not per_layer:                   # stacked matrices, or packed already
        return params
    packed = {k: tuple(map(_packed, v)) if _covered(v[0]) else v for k, v in per_layer.items()}
    params = {**params, "layers": {**layers, **packed}}
    if "lm_head" in params:
        head = params["lm_head"]
        if not precision.is_packed(head) and _covered_matrix(head):
            params["lm_head"] = {precision.PACKED: _like(head, packed_gemm.pack(np.asarray(head)))}
    elif TIED_HEAD not in params and getattr(params.get("embed"), "ndim", 0) == 2:
        embed = params["embed"]                                               # [V, d]
        head = np.asarray(embed).T                                            # [d, V]
        if _covered_matrix(head):
            params[TIED_HEAD] = {precision.PACKED: _like(embed, packed_gemm.pack(head))}
    return params


def unpack(params: dict) -> dict:
    """`pack`'s head undone (the packed copy of a tied head dropped); for stacked layouts,
    which `decoder.stack_layers` builds from any form (it unpacks the layer matrices)."""
    params = {k: v for k, v in params.items() if k != TIED_HEAD}
    if precision.is_packed(params.get("lm_head")):
        params["lm_head"] = precision.as_float(params["lm_head"])
    return params


def _covered(w) -> bool:
    k, n = precision.in_out_shape(w)
    return packed_gemm.why_not(w[precision.OUT_IN].dtype, k, n) is None


def _covered_matrix(a) -> bool:
    return getattr(a, "ndim", 0) == 2 and packed_gemm.why_not(a.dtype, *a.shape) is None


def _packed(w) -> dict:
    """{OUT_IN: [out, in]} -> {PACKED: ..}, host or device array as it came."""
    a = w[precision.OUT_IN]
    return {precision.PACKED: _like(a, packed_gemm.pack(np.asarray(a).T))}


def _like(model, packed: np.ndarray):
    return packed if isinstance(model, np.ndarray) else jax.numpy.asarray(packed)


def matmuls(params: dict) -> str:
    """What runs the weight matmuls (stats()): our packed GEMM kernel, or XLA's dots."""
    packed = [w for w in jax.tree.leaves(params, is_leaf=precision.is_packed)
              if precision.is_packed(w)]
    return "cpu_kernels.packed_gemm" if packed else "XLA dots"
