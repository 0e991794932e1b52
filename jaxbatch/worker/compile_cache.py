"""JAX's persistent compilation cache, on by default, next to the converted weights.

A second start of the same model and settings then reads every executable from disk instead of
compiling it. JAX keys it on the lowered HLO, the compile options, the backend and the jax
version, so a changed model, setting or version simply misses. The key is computed from a
lowered module, so beside it the runner keeps each step's lowered function (`lowered_dir`,
`lowered_store.py`): a second start reads those back instead of tracing the model again. We
tried storing serialized executables ourselves instead: on XLA:CPU (jax 0.10.2) a deserialized
executable can fail at run time ("Function wrapped_iota not found"), so executables are only
ever stored and read by JAX's own cache.
Turn both off with `LLM(..., compilation_cache=False)` or `JAXBATCH_COMPILATION_CACHE=0`.
"""
from __future__ import annotations

import os

import jax

from jaxbatch.cache_dir import cache_root

_enabled_dir: str | None = None


def enable(directory: str | None = None) -> str | None:
    """Points JAX at `directory` (default `<cache root>/xla`) and returns it, or None when the
    environment switches the cache off. The first call wins: JAX reads the setting once."""
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
    _enabled_dir = directory
    return directory


def lowered_dir() -> str | None:
    """Where the runner keeps lowered step functions (`lowered_store.py`): beside JAX's cache,
    None while the cache is off."""
    if _enabled_dir is None or os.environ.get("JAXBATCH_COMPILATION_CACHE", "1") == "0":
        return None
    return os.path.join(os.path.dirname(_enabled_dir), "lowered")
