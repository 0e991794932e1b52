"""Projections that read the same input, fused into one matrix per layer on CPU: q, k and v
("wqkv"), gate and up ("w_gate_up").

On CPU each layer's matrices are kept apart and transposed (`precision.to_storage`), and every
matmul is one library dot chosen by a `lax.switch` over the layers. There a dot of 16 rows
costs about as much in fixed overhead as in reading its weight, so one dot over [q; k; v]
instead of three saves two dots' overhead per layer, and two switches (docs/BENCHMARKS.md,
"Fused projections"). It also leaves fewer dots for XLA:CPU to compile and to set up on an
executable's first run.

A fused matrix is stored like its parts, a tuple over layers of {OUT_IN: [out, in]}, its
parts stacked along out in the order of `FUSED`. The parts' widths are not stored: q's is
o's input width (heads x head_dim), k and v split the rest evenly, gate and up split evenly.
Only float per-layer matrices are fused (int8 ones keep their parts); stacked layouts (GPUs,
tensor parallelism) never are, and `unfuse` gives the parts back for restacking.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxbatch.model import precision

FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def _per_layer_float(value) -> bool:
    return isinstance(value, tuple) and all(precision.is_out_in(w) for w in value)


def fuse_params(params: dict) -> dict:
    """`fuse` on a params dict in `precision.to_storage` form (other layouts pass unchanged)."""
    layers = params.get("layers")
    return {**params, "layers": fuse(layers)} if isinstance(layers, dict) else params


def fuse(layers: dict) -> dict:
    """A layers dict with each complete group of per-layer float parts replaced by its fused
    matrix (numpy parts stay numpy). Idempotent."""
    for name, parts in FUSED.items():
        values = [layers.get(p) for p in parts]
        if not all(_per_layer_float(v) for v in values):
            continue
        if len({v[0][precision.OUT_IN].dtype for v in values}) != 1:
            continue
        concat = np.concatenate if isinstance(values[0][0][precision.OUT_IN], np.ndarray) \
            else jnp.concatenate
        fused = tuple({precision.OUT_IN: concat([w[precision.OUT_IN] for w in per_part], axis=0)}
                      for per_part in zip(*values))                             # [sum out, in]
        layers = {k: v for k, v in layers.items() if k not in parts}
        layers[name] = fused
    return layers


def part_widths(layers: dict, name: str) -> tuple[int, ...]:
    """The out widths of fused matrix `name`'s parts, in `FUSED` order."""
    total = precision.in_out_shape(layers[name][0])[1]
    if name == "wqkv":
        q = precision.in_out_shape(_first(layers["wo"]))[0]
        return q, (total - q) // 2, (total - q) // 2
    return total // 2, total // 2


def split(y, widths: tuple[int, ...] | int) -> list:
    """[.., sum widths] -> one array per part (`widths` an int: that many equal parts)."""
    if isinstance(widths, int):
        return jnp.split(y, widths, axis=-1)
    return jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)


def part_shapes(layers: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of every part of the fused matrices in `layers`."""
    shapes = {}
    for name, parts in FUSED.items():
        if name in layers:
            fan_in = precision.in_out_shape(layers[name][0])[0]
            shapes.update({p: (fan_in, w) for p, w in zip(parts, part_widths(layers, name))})
    return shapes


def unfuse(layers: dict) -> dict:
    """The inverse of `fuse`: each fused matrix's parts back under their own names."""
    for name, parts in FUSED.items():
        if name not in layers:
            continue
        bounds = np.cumsum((0,) + part_widths(layers, name))
        per_part = {p: tuple({precision.OUT_IN: precision.out_in(w)[precision.OUT_IN][lo:hi]}
                             for w in layers[name])
                    for p, lo, hi in zip(parts, bounds[:-1], bounds[1:])}
        layers = {**{k: v for k, v in layers.items() if k != name}, **per_part}
    return layers


def _first(value):
    return value[0] if isinstance(value, tuple) else value
