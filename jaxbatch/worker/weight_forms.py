"""The weights in the form the engine's kernels read: `prepare(params, form)`.

The loader hands over plain arrays (`decoder.stack_layers`' layers dict: per-layer tuples or
stacks, int8 matrices as {"int8", "scale"}); each matrix becomes a typed weight
(`model/linear.py`) as `WeightForm` says, which the kernel seam (`kernels.py`) chose:

    per_layer   each layer's matrices kept apart (`linear.PerLayer`) instead of stacked
    transposed  per-layer float matrices stored [out, in] (`linear.OutIn`): XLA:CPU's form
    bits        stacked bf16 matrices kept as their bits (`linear.Bf16Bits`): XLA:CPU's form
    fused       per-layer q/k/v and gate/up as one matrix each ("wqkv", "w_gate_up",
                `layers.FUSED`): one matmul and one switch instead of three or two, where a
                small dot costs about as much in fixed overhead as in reading its weight
    packed      every per-layer float matrix the CPU GEMM covers, and the LM head (tied or
                not: a tied head costs a packed copy of the embedding, `tied_head`), packed
                once for it (`Packed`): XLA:CPU's dots of a few rows run far under the
                machine's bf16 and float32 rates, the kernel reads each packed weight once
                per call at close to them
    amx         the packed bf16 matrices met by the CPU's AMX tiles (`AmxPacked`) instead of
                AVX512-BF16: where the CPU has them, several times the rate
    w8a8        int8 matrices multiplied against activations quantized per token
                (`quantization="w8a8"`), their q/k/v and gate/up parts fused per layer:
                packed for the CPU's VNNI kernel (`PackedW8A8`, `w8a8_kernel="cpu"`) or its
                AMX int8 tiles (`AmxPackedW8A8`, "amx"), [out,
                in] for XLA's int8 dots ("xla", `OutInW8A8`), the Pallas kernel ("pallas")
                or the jnp reference ("jnp"), `W8A8`

`prepare` takes plain or already typed params (another engine's) and is cheap when they are
in the form already; `to_plain` gives plain params back (for quantizing or restacking).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import packed_gemm, w8a8_gemm
from pallas_kernels.int8 import quantize_int8
from jaxbatch.model.layers import FUSED
from jaxbatch.model.linear import Bf16Bits, Dense, Int8, Linear, OutIn, PerLayer
from jaxbatch.worker.kernel_forms import (W8A8, W8A8_FORMS, W8A8_KERNELS, AmxPacked,
                                          AmxPackedW8A8, OutInW8A8, Packed, PackedW8A8,
                                          PallasW8A8)

@dataclasses.dataclass(frozen=True)
class WeightForm:
    per_layer: bool = False
    transposed: bool = False
    bits: bool = False
    fused: bool = False
    packed: bool = False
    amx: bool = False
    w8a8_kernel: str | None = None      # int8 matrices against int8 activations: W8A8_KERNELS

    def describe(self) -> str:
        parts = [name for name, on in dataclasses.asdict(self).items()
                 if on is True]
        if self.w8a8_kernel:
            parts.append(f"w8a8 ({self.w8a8_kernel})")
        return ", ".join(parts) or "stacked"


# ---- plain params -> typed --------------------------------------------------------------
def prepare(params: dict, form: WeightForm) -> dict:
    if _in_form(params, form):
        return params
    plain = to_plain(params)
    layers = _layout(plain["layers"], form.per_layer)
    typed = {name: _typed(value, form) for name, value in layers.items()}
    if form.fused:
        typed = _fuse(typed)
    if form.w8a8_kernel:
        typed = _w8a8(typed, W8A8_KERNELS[form.w8a8_kernel], fuse=form.fused)
    packed_form = AmxPacked if form.amx else Packed
    if form.packed:
        typed = {name: _packed(value, packed_form) for name, value in typed.items()}
    out = {**{k: v for k, v in plain.items() if k not in ("lm_head", "tied_head")},
           "layers": typed}
    if "lm_head" in plain:
        out["lm_head"] = _lm_head(plain["lm_head"], form, packed_form)
    elif _head_w8a8_form(form) is not None or (
            form.packed and _covered(np.asarray(plain["embed"]).T)):
        tied = np.asarray(plain["embed"]).T                                  # [d, V]
        out["tied_head"] = _lm_head(tied if isinstance(plain["embed"], np.ndarray)
                                    else jnp.asarray(tied), form, packed_form)
    return out


def _head_w8a8_form(form: WeightForm):
    """The W8A8 form an LM head takes under w8a8 (the head is the decode step's largest
    matrix): the layers'; else None."""
    return W8A8_KERNELS[form.w8a8_kernel] if form.w8a8_kernel else None


def _lm_head(head, form: WeightForm, packed_form) -> Linear:
    """An LM head [d, V] in its kernel's form: int8 per vocabulary entry under w8a8 (the jnp
    reference where the CPU kernel does not cover it), packed where the GEMM covers it, else
    dense."""
    w8a8_form = _head_w8a8_form(form)
    if w8a8_form is not None:
        return _w8a8_matrix(Int8(*quantize_int8(head, axis=-2)), w8a8_form)
    if not (form.packed and _covered(head)):
        return Dense(head)
    return _tiles_or_loop(packed_form, head.dtype, head.shape[0]).of(head, head)


def _in_form(params: dict, form: WeightForm) -> bool:
    """Typed already in `form`, as far as `prepare` would change it."""
    matrices = [v for v in params["layers"].values() if _is_matrix_entry(v)]
    if not matrices or not all(isinstance(v, Linear) for v in matrices):
        return False
    if not isinstance(params.get("lm_head", Dense(None)), Linear):
        return False
    per_layer = any(isinstance(v, PerLayer) for v in matrices)
    fused = any(name in params["layers"] for name in FUSED)
    forms = [w for w in jax.tree.leaves(params, is_leaf=is_linear_leaf) if isinstance(w, Linear)]
    packed = any(isinstance(w, Packed) for w in forms)
    amx = any(isinstance(w, AmxPacked) for w in forms)
    kinds = {type(w) for w in forms if isinstance(w, W8A8_FORMS)}
    expected = W8A8_KERNELS[form.w8a8_kernel] if form.w8a8_kernel else None
    # a matrix the kernel does not cover keeps a fallback form (the reference; VNNI under AMX)
    w8a8_ok = (not kinds if expected is None
               else expected in kinds and kinds <= {expected, W8A8, PackedW8A8})
    # under w8a8 the head is int8 too, and nothing may be left to pack
    packed_ok = packed == form.packed or (not packed and _head_w8a8_form(form) is not None)
    return (per_layer == form.per_layer and fused == form.fused and packed_ok
            and (form.amx or not amx) and w8a8_ok)


def is_linear_leaf(value) -> bool:
    """A typed matrix, not PerLayer's tuple of them: a pytree leaf for `_in_form`'s walk."""
    return isinstance(value, Linear) and not isinstance(value, PerLayer)


def _is_matrix_entry(value) -> bool:
    return (isinstance(value, (tuple, dict, Linear))
            or getattr(value, "ndim", 0) >= 3)


def _layout(layers: dict, per_layer: bool) -> dict:
    """Plain matrices as a tuple of L (per_layer) or stacked."""
    out = {}
    for name, value in layers.items():
        if isinstance(value, tuple) and not per_layer:
            out[name] = _stack(value)
        elif per_layer and _is_stacked_matrix(value):
            out[name] = tuple(_unstack(value))
        else:
            out[name] = value
    return out


def _is_stacked_matrix(value) -> bool:
    if isinstance(value, dict):
        return value["int8"].ndim == 3
    return getattr(value, "ndim", 0) == 3


def _stack(per_layer: tuple):
    xp = np if isinstance(jax.tree.leaves(per_layer)[0], np.ndarray) else jnp
    if isinstance(per_layer[0], dict):
        return {part: xp.stack([w[part] for w in per_layer]) for part in per_layer[0]}
    return xp.stack(per_layer)


def _unstack(stacked):
    if isinstance(stacked, dict):
        return [{part: a[i] for part, a in stacked.items()}
                for i in range(stacked["int8"].shape[0])]
    return [stacked[i] for i in range(stacked.shape[0])]


def _typed(value, form: WeightForm):
    """A plain layers-dict entry -> its typed form (vectors stay arrays)."""
    if isinstance(value, tuple):
        return PerLayer(tuple(_typed_matrix(w, form, per_layer=True) for w in value))
    if isinstance(value, dict) or getattr(value, "ndim", 0) >= 3:
        return _typed_matrix(value, form, per_layer=False)
    return value


def _typed_matrix(w, form: WeightForm, per_layer: bool) -> Linear:
    if isinstance(w, dict):
        return Int8(w["int8"], w["scale"])
    if per_layer:
        return OutIn.of(w) if form.transposed else Dense(w)
    if form.bits and w.ndim == 3 and w.dtype == jnp.bfloat16:
        return Bf16Bits.of(w)
    return Dense(w)


def _fuse(layers: dict) -> dict:
    """Each complete group of per-layer [out, in] parts -> one matrix per layer, the parts
    stacked along out in `FUSED` order (numpy stays numpy)."""
    for name, parts in FUSED.items():
        values = [layers.get(p) for p in parts]
        if not all(isinstance(v, PerLayer) and all(isinstance(w, OutIn) for w in v.layers)
                   for v in values):
            continue
        if len({v.layers[0].w.dtype for v in values}) != 1:
            continue
        concat = np.concatenate if isinstance(values[0].layers[0].w, np.ndarray) else jnp.concatenate
        fused = PerLayer(tuple(OutIn(concat([w.w for w in per_part], axis=0))       # [sum out, in]
                               for per_part in zip(*(v.layers for v in values))))
        layers = {k: v for k, v in layers.items() if k not in parts}
        layers[name] = fused
    return layers


def _w8a8(layers: dict, form_class, fuse: bool) -> dict:
    """int8 matrices -> `form_class` (a W8A8 form); per layer, each complete group of int8
    parts fused into one matrix (`FUSED` order, along out) where `fuse`."""
    if fuse:
        for name, parts in FUSED.items():
            values = [layers.get(p) for p in parts]
            if not all(isinstance(v, PerLayer) and all(isinstance(w, Int8) for w in v.layers)
                       for v in values):
                continue
            concat = (np.concatenate if isinstance(values[0].layers[0].values, np.ndarray)
                      else jnp.concatenate)
            layers = {k: v for k, v in layers.items() if k not in parts}
            layers[name] = PerLayer(tuple(
                Int8(concat([w.values for w in per_part], axis=-1),
                     concat([w.scale for w in per_part], axis=-1))
                for per_part in zip(*(v.layers for v in values))))
    out = {}
    for name, value in layers.items():
        if isinstance(value, PerLayer) and all(isinstance(w, Int8) for w in value.layers):
            out[name] = PerLayer(tuple(_w8a8_matrix(w, form_class) for w in value.layers))
        elif isinstance(value, Int8) and value.values.ndim == 3:
            # a stack the layer scan slices; experts' stacks ([L, E, in, out]) stay weight-only
            out[name] = (W8A8 if form_class in PER_LAYER_ONLY else form_class)(value.values,
                                                                              value.scale)
        else:
            out[name] = value
    return out


# W8A8 forms of one layer's matrix; stacks, and matrices the VNNI kernel does not cover, take
# the reference
PER_LAYER_ONLY = (PackedW8A8, AmxPackedW8A8, OutInW8A8)


def _w8a8_matrix(w: Int8, form_class) -> Linear:
    if issubclass(form_class, PackedW8A8) and w8a8_gemm.why_not(*w.in_out) is not None:
        form_class = W8A8
    if form_class is AmxPackedW8A8 and not w8a8_gemm.amx_covers(w.in_out[0]):
        form_class = PackedW8A8             # the call would run the VNNI loop: say so
    return form_class.of(w.values, w.scale)


def _packed(value, packed_form):
    """Per-layer [out, in] float matrices the GEMM covers -> packed; the rest unchanged."""
    if not (isinstance(value, PerLayer) and all(isinstance(w, OutIn) for w in value.layers)):
        return value
    dtype = value.layers[0].w.dtype
    if packed_gemm.why_not(dtype, *value.in_out) is not None:
        return value
    packed_form = _tiles_or_loop(packed_form, dtype, value.in_out[0])
    return PerLayer(tuple(packed_form.of(w.w.T, w.w) for w in value.layers))


def _tiles_or_loop(packed_form, dtype, k: int):
    """AmxPacked only where the tiles cover a [k, n] matrix; elsewhere the call would run the
    AVX512 loop inside, so the matrix takes that form (and its epilogue threshold) and says so."""
    if packed_form is AmxPacked and not packed_gemm.amx_covers(dtype, k):
        return Packed
    return packed_form


def _covered(head) -> bool:
    return getattr(head, "ndim", 0) == 2 and packed_gemm.why_not(head.dtype, *head.shape) is None


# ---- typed -> plain ---------------------------------------------------------------------
def to_plain(params: dict) -> dict:
    """Typed params (any form) -> plain: per-layer tuples of [in, out] arrays or stacks, int8
    as {"int8", "scale"}, fused matrices split into their parts, the LM head an array, no
    packed copy of a tied head. Plain params pass unchanged."""
    if not isinstance(params.get("layers"), dict):
        return params
    layers = {}
    for name, value in params["layers"].items():
        if isinstance(value, PerLayer):
            layers[name] = tuple(_plain_matrix(w) for w in value.layers)
        elif isinstance(value, Linear):
            layers[name] = _plain_matrix(value)
        else:
            layers[name] = value
    out = {k: v for k, v in params.items() if k != "tied_head"}
    out["layers"] = _unfuse(layers)
    if isinstance(out.get("lm_head"), Linear):      # a W8A8 head's dequantized, in embed's dtype
        out["lm_head"] = out["lm_head"].to_float().astype(out["embed"].dtype)
    return out


def _plain_matrix(w: Linear):
    if isinstance(w, Int8):
        return {"int8": w.values, "scale": w.scale}
    if isinstance(w, W8A8_FORMS):
        return {"int8": w.int8_values(), "scale": w.scale}
    return w.to_float()


def _unfuse(layers: dict) -> dict:
    for name, parts in FUSED.items():
        if name not in layers:
            continue
        wo = layers["wo"][0] if isinstance(layers["wo"], tuple) else layers["wo"]
        q_width = (wo["int8"] if isinstance(wo, dict) else wo).shape[-2]
        first = layers[name][0]
        total = (first["int8"] if isinstance(first, dict) else first).shape[-1]
        widths = _part_widths(name, total, q_width)
        bounds = np.cumsum((0,) + widths)
        split = {p: tuple(_columns(w, lo, hi) for w in layers[name])
                 for p, lo, hi in zip(parts, bounds[:-1], bounds[1:])}
        layers = {**{k: v for k, v in layers.items() if k != name}, **split}
    return layers


def _columns(w, lo: int, hi: int):
    """Output columns [lo, hi) of a plain matrix (an int8 one's values and scales)."""
    if isinstance(w, dict):
        return {"int8": w["int8"][..., lo:hi], "scale": w["scale"][..., lo:hi]}
    return w[..., lo:hi]


def _part_widths(name: str, total: int, q_width: int) -> tuple[int, ...]:
    """The out widths of fused matrix `name`'s parts, in `FUSED` order: q's is o's input
    width (heads x head_dim, `q_width`), k and v split the rest evenly; gate and up split
    evenly."""
    if name == "wqkv":
        return q_width, (total - q_width) // 2, (total - q_width) // 2
    return total // 2, total // 2


def matrix_shapes(params: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of one layer's matrix for every matrix name of typed params, the parts of a
    fused matrix under their own names."""
    layers = params["layers"]
    shapes = {name: v.in_out for name, v in layers.items() if isinstance(v, Linear)}
    for name, value in layers.items():           # plain params (a loader's)
        first = value[0] if isinstance(value, tuple) else value
        first = first["int8"] if isinstance(first, dict) else first
        if not isinstance(value, Linear) and getattr(first, "ndim", 0) == (
                2 if isinstance(value, tuple) else 3):
            shapes[name] = tuple(first.shape[-2:])
    for name, parts in FUSED.items():
        if name in shapes:
            fan_in, total = shapes.pop(name)
            widths = _part_widths(name, total, shapes["wo"][0])
            shapes.update({p: (fan_in, w) for p, w in zip(parts, widths)})
    return shapes


def matmuls(params: dict) -> str:
    """What runs the weight matmuls (stats()): our packed GEMM kernel, or XLA's dots."""
    forms = {type(w) for w in jax.tree.leaves(params, is_leaf=is_linear_leaf)}
    names = [name for form, name in ((AmxPackedW8A8, "cpu_kernels.w8a8_gemm (AMX)"),
                                     (PackedW8A8, "cpu_kernels.w8a8_gemm"),
                                     (OutInW8A8, "XLA's int8 dots"),
                                     (PallasW8A8, "pallas_kernels.w8a8"),
                                     (W8A8, "the jnp W8A8 reference"),
                                     (AmxPacked, "cpu_kernels.packed_gemm (AMX)"),
                                     (Packed, "cpu_kernels.packed_gemm")) if form in forms]
    return " + ".join(names) or "XLA dots"
