"""Kernels of our own for CPUs, called from jitted code as XLA FFI custom calls.

Each kernel is C++ source compiled on first use (`build.py`: the machine's C++ compiler, the
result cached by source, flags and jaxlib version), with a Python wrapper that validates its
operands and says why it cannot run where it cannot (`unavailable_reason`); its reference is
the plain-jnp function it replaces, which the caller uses wherever the kernel is unavailable.

    paged_decode   decode attention over bf16 or float32 KV pages (reference:
                   pallas_kernels.xla_paged_attention.paged_decode_attention_xla)
    paged_prefill  prefill attention over bf16 KV pages (reference:
                   pallas_kernels.xla_paged_attention.tiled_prefill_attention_xla)
    packed_gemm    x @ W, bf16 or float32, over a weight packed once at load time
                   (reference: jnp.dot with float32 accumulation; jaxbatch/worker/weight_forms.py
                   packs the weights); silu_mul, the MLP's silu(gate) * up as its epilogue
    w8a8_gemm      x @ W for int8 weights against x quantized per row in the call (AVX512-VNNI
                   or AMX int8 tiles, the same int32 sums; reference:
                   pallas_kernels.w8a8.w8a8_reference, bit for bit), built from packed_gemm.cc's
                   loop
    add_rms_norm   a residual add and the RMSNorm after it, bf16 (reference: the jnp form of
                   jaxbatch.model.layers.add_rms_norm; the same sums, norms within a bf16
                   step: IEEE sqrt and division where XLA:CPU approximates)
    first_argmax   each row's first maximum of float32 logits, NaN as +inf, every sampling
                   path's argmax (reference: jaxbatch.worker.argmax.two_level_argmax; exact)

attention_simd.h holds the SIMD pieces the kernels share; decode_elems.h decode attention's
q.K and p.V per pool element type (a bf16 pool's keys are grouped: pallas_kernels/reference.py,
KEY_GROUP); pool_dispatch.h how each kernel runs its work on XLA's intra-op threads (and hands
it to them when called on another thread); kv_prefetch.h (its memory in kv_hints.py) the hint
channel through which decode attention names the next layer's pages to the GEMMs before it;
call_observer.h what each call says about itself, recorded in an instrumented build only (the
lab's `python -m benchmarks calls`); checks.h what every handler checks before it runs;
handout.py how that memory of ours reaches each library.

No switch is read from the environment (only the toolchain, CXX, and the cache's place,
build.py): the engine says how the kernels are used, from its config.

    configure(mode="auto", kv_prefetch=True)
                           mode "auto": each kernel runs where it can, else the jnp path
                           (the reason logged once, as a warning of the "cpu_kernels"
                           logger); "off": every kernel reports "turned off"; "required": a
                           kernel that cannot run raises RuntimeError. kv_prefetch False turns
                           the hint channel off (results are the same either way).
    availability.instrument(flags, on_load)
                           before any kernel registers: this process's kernels are built
                           with an instrument's flags and handed to it as they load (the
                           lab's call log, `python -m benchmarks calls`); production builds
                           carry none

    KERNELS                the kernel modules: each has TARGETS (its FFI targets) and
                           unavailable_reason(), which registers them where they run
    register_all()         registers every kernel that runs here (what a process must do
                           before it runs a stored step that may call one); returns the
                           reasons of those that do not, in KERNELS order
"""
from __future__ import annotations

from cpu_kernels import (add_rms_norm, first_argmax, packed_gemm, paged_decode, paged_prefill,
                         w8a8_gemm)
from cpu_kernels.availability import configure

KERNELS = (paged_decode, paged_prefill, packed_gemm, w8a8_gemm, add_rms_norm, first_argmax)


def register_all() -> tuple:
    return tuple(kernel.unavailable_reason() for kernel in KERNELS)
