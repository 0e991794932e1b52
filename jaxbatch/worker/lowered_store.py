"""Lowered step functions kept on disk, so a second start does not trace the model again.

JAX's persistent compilation cache (`compile_cache.py`) is keyed on the lowered module, so on
its own every start still traces and lowers each function (about 65 ms a key on the embedded
model, most of a cached warm-up). Here each key's function is exported once (`jax.export`: the
StableHLO module with its argument and result structure) and stored; a later start reads it
back and lowers only a thin `Exported.call` wrapper around it (about 10 ms), whose module, the
same bytes every time, is what JAX's cache finds the executable under (XLA inlines the call:
the optimized HLO is the plain `jax.jit` one). The first start pays for it: exporting and then
lowering the wrapper costs about 25 ms a key more than a plain lowering (about 2 % of a cold
warm-up, whose time is compiling). Executables themselves
are never stored by us: a deserialized XLA:CPU executable of our own serialization could fail at
run time ("Function wrapped_iota not found"); JAX's cache deserializes its own way, which works.

An entry is used only if its fingerprint matches (jax and jaxlib versions, the device, the
traced source files, the settings the runner was built with: `fingerprint`) and its argument
structure and shapes equal those of the call; anything else, an unreadable file included, is a
miss: the function is traced and exported again, and the entry replaced. Entries are pickles
(read only from the user's own cache directory, like JAX's cache entries).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle

import jax
from jax import export

import cpu_kernels

logger = logging.getLogger(__name__)

# The code that ends up inside a lowered step (folders: every .py file in them, subfolders too).
_TRACED_SOURCES = ("jaxbatch/model", "pallas_kernels", "cpu_kernels", "jaxbatch/worker",
                   "jaxbatch/sampling_params.py", "jaxbatch/core/config.py", "jaxbatch/core/plan.py")
_FORMAT = 1
# Our CPU kernels' custom calls (cpu_kernels/): registered in-process before a step holding one
# is traced, so a stored step may keep them.
_OUR_CUSTOM_CALLS = [export.DisabledSafetyCheck.custom_call(t)
                     for kernel in cpu_kernels.KERNELS for t in kernel.TARGETS]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = []
    for entry in _TRACED_SOURCES:
        full = os.path.join(root, entry)
        if os.path.isdir(full):
            paths += [os.path.join(folder, f) for folder, _, files in os.walk(full)
                      for f in files if f.endswith((".py", ".cc", ".h"))]
        else:
            paths.append(full)
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def fingerprint(*parts) -> str:
    """Everything besides the key and the argument shapes that changes what gets lowered:
    versions, device, the traced source, JAX settings that change tracing, and the caller's
    `parts` (the runner's model and scheduler settings, backend, dtypes)."""
    import jaxlib
    device = jax.devices()[0]
    settings = (jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision),
                str(jax.config.jax_numpy_rank_promotion), str(jax.config.jax_numpy_dtype_promotion),
                # which kernels run, each registered now: a stored step may call them
                cpu_kernels.register_all())
    text = repr((_FORMAT, jax.__version__, jaxlib.__version__, device.platform,
                 getattr(device, "device_kind", ""), source_hash(), settings) + tuple(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _signature(args):
    leaves, tree = jax.tree.flatten((tuple(args), {}))      # an export's in_tree: (args, kwargs)
    return tree, [(tuple(x.shape), jax.numpy.dtype(x.dtype)) for x in leaves]


def _matches(exported: export.Exported, args) -> bool:
    tree, avals = _signature(args)
    return (exported.in_tree == tree
            and [(tuple(a.shape), a.dtype) for a in exported.in_avals] == avals)


class LoweredStore:
    def __init__(self, directory: str, fingerprint_: str):
        self.directory = os.path.join(directory, fingerprint_)
        self.hits = 0

    def _path(self, key: tuple) -> str:
        return os.path.join(self.directory, "_".join(str(k) for k in key) + ".pkl")

    def lower(self, key: tuple, fn, donate: tuple, args):
        """`jax.jit(fn, donate_argnums=donate).lower(*args)`'s equivalent, from the stored
        export of `key` when there is a usable one, else exported (and stored) now."""
        exported = self._load(key, args)
        if exported is None:
            exported = export.export(jax.jit(fn, donate_argnums=donate),
                                     disabled_checks=_OUR_CUSTOM_CALLS)(*args)
            self._save(key, exported)
        else:
            self.hits += 1
        return jax.jit(exported.call, donate_argnums=donate).lower(*args)

    def _load(self, key: tuple, args):
        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                exported = pickle.load(f)
        except Exception as e:                  # noqa: BLE001 - truncated, other jax: a miss
            logger.warning("ignoring unreadable lowered step %s: %s", path, e)
            return None
        if not isinstance(exported, export.Exported) or not _matches(exported, args):
            logger.warning("ignoring lowered step %s: other argument shapes", path)
            return None
        return exported

    def _save(self, key: tuple, exported) -> None:
        # The vjp builder is a closure (not picklable) and serves only differentiation.
        fields = {f.name for f in dataclasses.fields(exported)}
        if "_get_vjp" in fields:
            exported = dataclasses.replace(exported, _get_vjp=None)
        try:
            payload = pickle.dumps(exported)
        except Exception as e:                  # noqa: BLE001 - cannot keep it: just skip
            logger.warning("cannot store lowered step %s: %s", key, e)
            return
        os.makedirs(self.directory, exist_ok=True)
        tmp = self._path(key) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, self._path(key))        # readers never see a partial file
