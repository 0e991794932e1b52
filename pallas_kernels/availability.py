"""Which GPU kernel path this jax can run, and lowering for the `cuda` platform without a GPU.

Pallas' Triton backend is deprecated from jax 0.11 and will be removed; where it is missing,
`jax.experimental.pallas.triton` does not import or `pallas_call` raises NotImplementedError
while lowering. `triton_unavailable_reason()` tries what the engine would do (import, then
lower a tiny decode and ragged kernel for the GPU) and says why it fails, or None if it works;
`jaxbatch.worker.attention.resolve_backend` uses it to pick `pallas` or fall back to `xla`.

Lowering for cuda on a machine without a GPU (tests, CI): jax 0.10 lowers Triton kernels with
`lowering_platforms=("cuda",)` alone; jax 0.11 asks the target GPU's compute capability and
raises "No supported GPU devices found, please specify an abstract GPU device" unless an
abstract device is in scope. `abstract_gpu()` provides one (an H200 by default) through
`jax.sharding.use_abstract_mesh`, which exists in both versions.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

# The GPU the project targets (sm_90). Any kind in jax's gpu_info table works.
DEFAULT_DEVICE_KIND = "NVIDIA H200"
H200_SM_COUNT = 132


def abstract_gpu(device_kind: str = DEFAULT_DEVICE_KIND, num_cores: int = H200_SM_COUNT):
    """Context in which `lower(lowering_platforms=("cuda",))` targets `device_kind` even where no
    GPU is attached. A no-op context on a jax without abstract devices."""
    device_cls = getattr(jax.sharding, "AbstractDevice", None)
    use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
    if device_cls is None or use_mesh is None:  # pragma: no cover - older jax
        return contextlib.nullcontext()
    from jax.sharding import AbstractMesh, AxisType
    device = device_cls(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    # One Explicit axis: per jax's docs a top-level abstract mesh takes effect only when every
    # axis is Explicit. With one device nothing is sharded.
    mesh = AbstractMesh((1,), ("_gpu",), (AxisType.Explicit,), abstract_device=device)
    return use_mesh(mesh)


def lower_for_cuda(fn, *args, device_kind: str = DEFAULT_DEVICE_KIND):
    """jax.jit(fn) traced on `args` (arrays or ShapeDtypeStructs) and lowered for cuda; returns
    the Lowered object. Works with and without a GPU, on jax 0.10 and 0.11."""
    with abstract_gpu(device_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _probe_shapes(dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    pool = sds((2, 9, 16, 64), dtype)
    decode = (sds((2, 8, 64), dtype), pool, pool, sds((2, 4), jnp.int32), sds((2,), jnp.int32))
    ragged = (sds((16, 8, 64), dtype), pool, pool, sds((2,), jnp.int32), sds((2, 4), jnp.int32),
              sds((3,), jnp.int32), sds((1,), jnp.int32))
    return decode, ragged


def triton_import_error() -> str | None:
    """None if `jax.experimental.pallas.triton` imports (all the interpreter needs), else why."""
    try:
        from jax.experimental.pallas import triton as _pltriton  # noqa: F401
    except Exception as e:  # ImportError once jax removes the backend
        return f"jax.experimental.pallas.triton does not import: {type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=None)
def triton_unavailable_reason() -> str | None:
    """None if the Pallas Triton kernels import and lower for the GPU, else why not.

    On a machine with a GPU both kernels are compiled and run once on zeros; elsewhere they are
    lowered for an abstract H200 (cuda), which is what CI checks. Cached: it costs a second or
    so the first time."""
    why = triton_import_error()
    if why is not None:
        return why
    try:
        from pallas_kernels.paged_decode import paged_decode_attention
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        decode, ragged = _probe_shapes()
        if jax.default_backend() == "gpu":
            # A GPU is here: compile and run both kernels once (Triton compiles at XLA compile
            # time, so lowering alone would not catch a compiler failure).
            for fn, shapes in ((paged_decode_attention, decode), (ragged_paged_attention, ragged)):
                out = jax.jit(fn)(*(jnp.zeros(s.shape, s.dtype) for s in shapes))
                if not bool(jnp.isfinite(out.astype(jnp.float32)).all()):
                    return "the Pallas Triton kernels run but return non-finite values"
        else:
            lower_for_cuda(paged_decode_attention, *decode)
            lower_for_cuda(ragged_paged_attention, *ragged)
    except Exception as e:  # NotImplementedError where the backend is gone, anything else
        return f"the Pallas Triton kernels do not lower: {type(e).__name__}: {str(e)[:300]}"
    return None
