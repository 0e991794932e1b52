"""Chooses how attention is computed, and what the host must lay out for it.

    xla               plain jnp shaped for XLA on CPU: cost follows each sequence's own pages
                      (`pallas_kernels/xla_paged_attention.py`); the CPU default
    reference         the plain-jnp oracle (`pallas_kernels/reference.py`): every row pays for
                      the longest block table of the call; for tests
    pallas            the Pallas kernels (Triton backend); the GPU default where this jax
                      can still import and lower them
    pallas_interpret  the same kernels run by the Pallas interpreter on CPU, for tests

`auto` resolves to `pallas` on a GPU whose jax imports and lowers the Pallas Triton kernels,
and to `xla` everywhere else: on CPU, and on a GPU with a jax whose Triton backend is gone
(deprecated from jax 0.11; `xla` is plain jnp and runs on any device). What was picked is what
`LLMEngine.stats()["attention_backend"]` reports.

Each backend is an object (`base.py`: the interface) with its host-side metadata builder
and its device-side attend functions: `work_lists.py` (xla), `block_tables.py` (reference,
pallas, pallas_interpret).
"""
from __future__ import annotations

import jax

from jaxbatch.worker.attention.base import AttentionBackend
from jaxbatch.worker.attention.block_tables import BlockTableBackend
from jaxbatch.worker.attention.mixed import mixed_attend
from jaxbatch.worker.attention.work_lists import WorkListBackend
from pallas_kernels import availability

__all__ = ["AttentionBackend", "BACKENDS", "get_backend", "mixed_attend", "resolve_backend"]

BACKENDS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


def _platform() -> str:
    """jax's default backend ("cpu", "gpu", "tpu"); a function so tests can pretend."""
    return jax.default_backend()


def resolve_backend(backend: str) -> str:
    """The concrete backend for `backend`; `auto` -> `pallas` or `xla` (see the module doc).

    Asking for `pallas` or `pallas_interpret` on a jax whose Pallas Triton backend is missing
    or does not lower raises ValueError here, before anything is compiled."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    platform = _platform()
    if backend == "auto":
        if platform == "gpu" and availability.triton_unavailable_reason() is None:
            return "pallas"
        return "xla"
    if backend in ("pallas", "pallas_interpret"):
        why = (availability.triton_unavailable_reason() if backend == "pallas"
               else availability.triton_import_error())
        if why is not None:
            raise ValueError(f"attention_backend={backend!r} is not usable with jax "
                             f"{jax.__version__}: {why}. Use 'auto' or 'xla'.")
    return backend


def get_backend(backend: str):
    """The backend object for a name (`auto` resolved first, see `resolve_backend`)."""
    name = resolve_backend(backend)
    if name == "xla":
        return WorkListBackend()
    return BlockTableBackend(name)
