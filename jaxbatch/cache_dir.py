"""Where jaxbatch keeps what it builds once per machine (converted weights, compiled steps,
the CPU kernels' libraries): $JAXBATCH_CACHE, else $XDG_CACHE_HOME/jaxbatch, else
~/.cache/jaxbatch. The one place that reads those variables (cpu_kernels/build.py, which
imports nothing of jaxbatch, mirrors it)."""
from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("JAXBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxbatch")
