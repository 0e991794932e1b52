"""The kernel seam: what runs each heavy operation of an engine, chosen once, with the reason.

    matmul              the weights' form (`weight_forms.py`): packed for our C++ GEMM
                        (`cpu_kernels.packed_gemm`, its silu * up epilogue included; a bf16
                        model's met by AMX tiles where the CPU has them, else AVX512-BF16),
                        or the forms XLA's dots read best (cpu_gemm='xla')
    w8a8                `quantization="w8a8"`: the int8 matrices' kernel against activations
                        quantized per token: on a CPU `cpu_kernels.w8a8_gemm` over AMX int8
                        tiles where it has them, else AVX512-VNNI (refused where neither
                        runs), or XLA's int8 dots (cpu_gemm='xla'); the Pallas kernel on a
                        GPU; else the jnp reference
    add_norm            a residual add and the RMSNorm after it: `cpu_kernels.add_rms_norm`
                        (bf16) or jnp
    decode_attention    the xla backend's decode attention: `cpu_kernels.paged_decode` (its
                        q.K and p.V on AMX tiles where the CPU has them, the pages fit them
                        and, under cpu_gemm 'auto', the query group is large enough for them
                        to be faster; 'amx' takes them wherever they fit) or jnp work lists
                        (other backends bring their own kernels)
    prefill_attention   the xla backend's prefill attention: `cpu_kernels.paged_prefill` or jnp
                        query tiles; the backend lays a call out for the one it is handed
    argmax              every sampling path's first maximum: `cpu_kernels.first_argmax`
                        (float32 logits) or jnp
    kv_prefetch         the C++ decode attention naming the next layer's pages to the GEMMs
                        that run before that layer's attention (a hint: results are the same
                        either way; it lives inside the kernels, so a layer order that puts no
                        GEMM between two attentions simply loses it)

`choose` decides from the platform, the dtypes, the model and the options (`KernelOptions`:
`EngineConfig`'s cpu_kernels, cpu_gemm, kv_prefetch and weight_layout); `KernelChoice.reasons` says why
each entry is what it is (logged once at start-up, `stats()["kernels"]`). The C++ kernels are
chosen only on a CPU, so nothing below them needs a platform switch.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from cpu_kernels import (add_rms_norm, availability, first_argmax, kv_hints, packed_gemm,
                         paged_decode, paged_prefill, w8a8_gemm)
from jaxbatch.model import norms
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.kernels import Kernels
from jaxbatch.worker.argmax import two_level_argmax
from jaxbatch.worker.weight_forms import WeightForm

logger = logging.getLogger(__name__)

CPU_KERNEL_MODES = ("auto", "off", "required")
CPU_GEMMS = ("auto", "amx", "packed", "xla")
WEIGHT_LAYOUTS = ("auto", "per_layer", "stacked")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    cpu_kernels: str = "auto"       # auto: where they run; off: never; required: or an error
    kv_prefetch: bool = True
    weight_layout: str = "auto"     # auto: per layer on CPU, stacked elsewhere
    cpu_gemm: str = "auto"          # matmuls (bf16, w8a8) and decode attention's tiles: our
                                    # kernels on AMX or AVX512, or XLA's
    int8_activations: bool = False  # quantization="w8a8": int8 matrices x int8 activations


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    kernels: Kernels                        # what the model calls (model/kernels.py)
    weight_form: WeightForm                 # the matrices' form (weight_forms.py)
    decode_attention: Callable | None       # the xla backend's C++ decode attention, or None
    prefill_attention: Callable | None      # the xla backend's C++ prefill attention, or None
    argmax: Callable
    reasons: tuple                          # ((entry, what runs it and why), ...)

    def describe(self) -> dict[str, str]:
        return dict(self.reasons)


def choose(*, model_cfg: ModelConfig, dtype, pool_dtype, options: KernelOptions = KernelOptions(),
           tensor_parallel: bool = False, platform: str | None = None,
           block_size: int = 16) -> KernelChoice:
    """The engine's kernels. `dtype`: the activations' (the model's); `pool_dtype`: the KV
    pages' storage dtype (`precision.kv_pool_dtype`); `block_size`: the keys of a page."""
    if options.cpu_kernels not in CPU_KERNEL_MODES:
        raise ValueError(f"cpu_kernels={options.cpu_kernels!r}; choose one of "
                         f"{', '.join(CPU_KERNEL_MODES)}")
    if options.cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm={options.cpu_gemm!r}; choose one of {', '.join(CPU_GEMMS)}")
    if options.weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={options.weight_layout!r}; choose one of "
                         f"{', '.join(WEIGHT_LAYOUTS)}")
    platform = platform or jax.default_backend()
    on_cpu = platform == "cpu"
    per_layer = (options.weight_layout == "per_layer" or
                 (options.weight_layout == "auto" and on_cpu and not tensor_parallel))
    dtype = jnp.dtype(dtype)
    if options.cpu_gemm == "amx":
        _check_amx_applies(options, dtype, per_layer, platform)
    reasons = {}

    def cpu_kernel(entry: str, reason: str | None, name: str, fallback: str) -> bool:
        """Whether `entry` takes C++ kernel `name`; `reason`: why it cannot, or None."""
        if not on_cpu:
            reason = f"{platform}, not a CPU"
        elif options.cpu_kernels == "off":
            reason = "turned off (cpu_kernels='off')"
        if reason is None:
            reasons[entry] = f"cpu_kernels.{name}"
            return True
        if on_cpu and options.cpu_kernels == "required":
            raise ValueError(f"cpu_kernels='required', but {entry} cannot take "
                             f"cpu_kernels.{name}: {reason}")
        reasons[entry] = f"{fallback} ({reason})"
        return False

    heads = (pool_dtype, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim,
             model_cfg.attn_soft_cap)
    amx = False
    if (on_cpu and options.cpu_gemm == "xla" and dtype == jnp.bfloat16
            and options.cpu_kernels != "off"):
        reasons["matmul"] = "XLA dots (cpu_gemm='xla')"
        packed = False
    else:
        packed = cpu_kernel("matmul", _gemm_reason(dtype, per_layer), "packed_gemm", "XLA dots")
        amx = packed and dtype == jnp.bfloat16 and _amx_tiles(options, packed_gemm.amx_why_not)
        if amx:
            reasons["matmul"] += " (AMX tiles)"
    norm = cpu_kernel("add_norm", _norm_reason(dtype, per_layer), "add_rms_norm", "jnp")
    decode = cpu_kernel("decode_attention", paged_decode.why_not(*heads), "paged_decode",
                        "jnp work lists")
    decode_amx = decode and _decode_tiles(options, model_cfg, pool_dtype, block_size)
    if decode_amx:
        reasons["decode_attention"] += " (AMX tiles)"
    prefill = cpu_kernel("prefill_attention", paged_prefill.why_not(*heads), "paged_prefill",
                         "jnp query tiles")
    argmax = cpu_kernel("argmax", first_argmax.unavailable_reason(), "first_argmax",
                        "jnp two-level")
    w8a8_kernel = None
    if options.int8_activations:
        w8a8_kernel, reasons["w8a8"] = _w8a8_kernel(platform, options, per_layer)
    # Only the packed AVX512 loop (bf16, float32, and W8A8's on VNNI) reads the hints; AMX
    # tiles and XLA's dots do not, and decode attention then publishes none.
    hint_readers = w8a8_kernel == "cpu" if w8a8_kernel else packed and not amx
    prefetch = options.kv_prefetch and decode and hint_readers
    reasons["kv_prefetch"] = (
        "on: decode attention names the next layer's pages to the GEMMs" if prefetch
        else "off" if not options.kv_prefetch
        else "off (needs the C++ decode attention and the AVX512 GEMM; AMX tiles and XLA's "
             "dots read no hints)")
    kv_hints.set_enabled(options.kv_prefetch)
    form = WeightForm(per_layer=per_layer, transposed=on_cpu and per_layer, bits=on_cpu,
                      fused=on_cpu and per_layer, packed=packed, amx=amx,
                      w8a8_kernel=w8a8_kernel)
    reasons["weights"] = form.describe()
    reasons = tuple(reasons.items())
    return KernelChoice(
        kernels=Kernels(add_norm=_add_norm_kernel if norm else norms.add_rms_norm,
                        reasons=reasons),
        weight_form=form,
        decode_attention=(functools.partial(_decode_kernel, num_layers=model_cfg.num_layers,
                                            publish=prefetch, amx=decode_amx)
                          if decode else None),
        prefill_attention=paged_prefill.paged_prefill_attention if prefill else None,
        argmax=_argmax_kernel if argmax else two_level_argmax,
        reasons=reasons)


def log_choice(choice: KernelChoice) -> None:
    logger.info("kernels: %s", "; ".join(f"{k}: {v}" for k, v in choice.reasons))


def _w8a8_kernel(platform: str, options: KernelOptions, per_layer: bool) -> tuple[str, str]:
    """(W8A8 kernel, why): on a CPU our kernel over AMX int8 tiles where it has them, else over
    AVX512-VNNI (an error where neither runs), or XLA's int8 dots (cpu_gemm='xla'); the Pallas
    kernel on a GPU; else the jnp reference."""
    if platform == "gpu":
        return "pallas", "pallas_kernels.w8a8 (int8 MMA)"
    if platform != "cpu":
        return "jnp", f"the jnp reference ({platform})"
    if options.cpu_kernels == "off":
        reason = "turned off (cpu_kernels='off')"
    elif options.cpu_gemm == "xla":
        if not per_layer:
            return "jnp", "the jnp reference: XLA's int8 dots, [in, out] (stacked layout)"
        return "xla", "XLA's int8 dots, [out, in] (cpu_gemm='xla'; activations quantized per token)"
    else:
        reason = w8a8_gemm.unavailable_reason()
    if reason:
        raise ValueError(f"quantization='w8a8' runs on this CPU's AVX512-VNNI or AMX kernel "
                         f"(cpu_kernels.w8a8_gemm), which cannot run here: {reason}; "
                         "quantization='int8' (weight-only) runs anywhere")
    if not per_layer:
        return "jnp", "the jnp reference (stacked weight layout: the kernel takes per-layer weights)"
    if _amx_tiles(options, w8a8_gemm.amx_why_not):
        return "amx", "cpu_kernels.w8a8_gemm (AMX int8 tiles, activations quantized per token)"
    return "cpu", "cpu_kernels.w8a8_gemm (AVX512-VNNI, activations quantized per token)"


def _amx_tiles(options: KernelOptions, why_not) -> bool:
    """Whether our GEMM meets its packed weights with AMX tiles: cpu_gemm 'amx' (or an error
    saying why it cannot), or 'auto' where the CPU has them; 'packed' keeps AVX512."""
    if options.cpu_gemm not in ("auto", "amx"):
        return False
    reason = why_not()
    if reason and options.cpu_gemm == "amx":
        raise ValueError(f"cpu_gemm='amx', but AMX tiles cannot run here: {reason}")
    return reason is None


def _decode_tiles(options: KernelOptions, model_cfg: ModelConfig, pool_dtype,
                  block_size: int) -> bool:
    """Whether decode attention's q.K and p.V take AMX tiles: where they run and the pages fit
    them, under cpu_gemm 'amx', or 'auto' where the query group is large enough for them to be
    the faster (`paged_decode.AMX_FASTER_FROM_GROUP`); never under 'packed' or 'xla'."""
    group = model_cfg.num_heads // model_cfg.num_kv_heads
    if options.cpu_gemm == "auto" and group < paged_decode.AMX_FASTER_FROM_GROUP:
        return False
    return (options.cpu_gemm in ("auto", "amx") and
            paged_decode.amx_why_not(pool_dtype, block_size, model_cfg.head_dim) is None)


def _check_amx_applies(options: KernelOptions, dtype, per_layer: bool, platform: str) -> None:
    """cpu_gemm='amx' is honoured or refused, never ignored: it needs a CPU, our kernels, the
    per-layer weights they take, and bf16 matrices or W8A8's int8 ones (no float32 tiles)."""
    why = (f"a {platform} backend" if platform != "cpu"
           else "cpu_kernels='off'" if options.cpu_kernels == "off"
           else "a stacked weight layout (the kernels take per-layer weights)" if not per_layer
           else f"{dtype.name} matrices (AMX tiles take bf16, or int8 with quantization='w8a8')"
           if dtype != jnp.bfloat16 and not options.int8_activations else None)
    if why:
        raise ValueError(f"cpu_gemm='amx' cannot apply to {why}; cpu_gemm='auto' picks what runs")


def _gemm_reason(dtype, per_layer: bool) -> str | None:
    if not per_layer:
        return "stacked weight layout"
    if dtype not in (jnp.bfloat16, jnp.float32):
        return f"{dtype.name} weights"
    return packed_gemm.unavailable_reason()


def _norm_reason(dtype, per_layer: bool) -> str | None:
    if dtype != jnp.bfloat16:
        return f"a {dtype.name} model (the kernel is bf16's)"
    if not per_layer:
        return "stacked weight layout"
    return add_rms_norm.unavailable_reason()


def _add_norm_kernel(x, h, weight, eps, offset=0.0):
    """The C++ add + norm for bf16 activations (jnp for any other: a float32 draft's, say). It
    rounds the sum as the jnp form does, but takes the IEEE square root and division where
    XLA:CPU takes its own approximations, so a normed value may differ by a bf16 step."""
    if x.dtype != jnp.bfloat16:
        return norms.add_rms_norm(x, h, weight, eps, offset)
    return tuple(add_rms_norm.add_rms_norm(x, h, weight, eps, offset))


def _decode_kernel(q, k_pages, v_pages, *meta, scale, window, num_layers: int, publish: bool,
                   amx: bool):
    """The C++ decode attention, told how far the next layer's blocks lie in the folded pool
    (for its prefetch hints; 0 where no GEMM reads them: nothing published)."""
    return paged_decode.paged_decode_attention(
        q, k_pages, v_pages, *meta, scale=scale, window=window,
        next_layer_blocks=k_pages.shape[1] // num_layers if publish else 0, amx=amx)


def _argmax_kernel(x):
    """The C++ first maximum over float32 [N, V] logits; jnp for anything else."""
    if x.dtype != jnp.float32 or x.ndim != 2:
        return two_level_argmax(x)
    return first_argmax.first_argmax(x)
