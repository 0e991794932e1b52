"""Compiled code kept across runs, on by default, next to the converted weights.

Two layers: JAX's persistent compilation cache (keyed by JAX on the lowered HLO, the compile
options and the backend: it still needs every function traced), and under it our executable
store (`executable_store.py`), which skips tracing too. Turn both off with
`LLM(..., compilation_cache=False)` or `JAXBATCH_COMPILATION_CACHE=0`.
"""
from __future__ import annotations

import os

import jax

from jaxbatch.model.loader import cache_root

_enabled_dir: str | None = None


def enable(directory: str | None = None) -> str | None:
    """Points JAX at `directory` (default `<cache root>/xla`); returns the executable store's
    directory beside it, or None when the environment switches caching off. The first call
    wins: JAX reads the setting once."""
    global _enabled_dir
    if os.environ.get("JAXBATCH_COMPILATION_CACHE", "1") == "0":
        return None
    if _enabled_dir is not None:
        return _enabled_dir
    directory = directory or os.path.join(cache_root(), "xla")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # Every executable counts: ours compile in about a second each, below JAX's default floor.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled_dir = os.path.join(os.path.dirname(directory), "executables")
    return _enabled_dir
