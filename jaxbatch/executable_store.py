"""Compiled step executables kept on disk, so a second start skips tracing and compiling.

JAX's persistent compilation cache (`compile_cache.py`) still needs every function traced and
lowered before it can look the executable up, which for a few dozen shape buckets is seconds.
This store keys serialized executables by everything that shapes them instead: the runner's
fingerprint (model and scheduler settings, dtype, attention backend, jax/jaxlib versions, the
device, and a hash of this package's source) plus the bucket. A miss compiles as usual; an
unreadable or stale entry is treated as a miss.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle

import jax

logger = logging.getLogger(__name__)

# The code that ends up inside an executable (folders: every .py file in them).
_TRACED_SOURCES = ("jaxbatch/model", "pallas_kernels", "jaxbatch/attention.py",
                   "jaxbatch/sampler.py", "jaxbatch/sampling_params.py", "jaxbatch/runner.py",
                   "jaxbatch/step_inputs.py", "jaxbatch/kv_cache.py", "jaxbatch/config.py",
                   "jaxbatch/plan.py")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = []
    for entry in _TRACED_SOURCES:
        full = os.path.join(root, entry)
        if os.path.isdir(full):
            paths += [os.path.join(full, f) for f in os.listdir(full) if f.endswith(".py")]
        else:
            paths.append(full)
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def fingerprint(*parts) -> str:
    """Everything besides the bucket that changes what gets compiled: versions, device, the
    traced source, the settings JAX and XLA compile under, and the caller's `parts`."""
    import jaxlib
    device = jax.devices()[0]
    compile_settings = (os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
                        str(jax.config.jax_default_matmul_precision),
                        getattr(device.client, "platform_version", ""))
    text = repr((jax.__version__, jaxlib.__version__, device.platform,
                 getattr(device, "device_kind", ""), source_hash(), compile_settings)
                + tuple(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ExecutableStore:
    def __init__(self, directory: str, fingerprint_: str):
        self.directory = os.path.join(directory, fingerprint_)

    def _path(self, key: tuple) -> str:
        return os.path.join(self.directory, "_".join(str(k) for k in key) + ".bin")

    def load(self, key: tuple):
        path = self._path(key)
        if not os.path.exists(path):
            return None
        from jax.experimental import serialize_executable
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except Exception as e:                  # stale format, truncated write, other jax
            logger.warning("ignoring unreadable executable %s: %s", path, e)
            return None

    def save(self, key: tuple, executable) -> None:
        from jax.experimental import serialize_executable
        try:
            payload = pickle.dumps(serialize_executable.serialize(executable))
        except Exception as e:                  # a backend that cannot serialize: just skip
            logger.warning("cannot store executable %s: %s", key, e)
            return
        os.makedirs(self.directory, exist_ok=True)
        tmp = self._path(key) + f".{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, self._path(key))        # readers never see a partial file
