"""Bad `jaxbatch serve` flags are a clean argparse error (exit 2, the flag named), before
anything loads: --port out of range once logged 70000 and listened on 4464, and --block-size 0
was a ZeroDivisionError deep in the engine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from server_utils import ROOT


@pytest.mark.parametrize("flag,value", [("--port", "70000"), ("--port", "-1"),
                                        ("--block-size", "0"), ("--max-num-seqs", "0"),
                                        ("--max-num-queued-reqs", "0"),
                                        ("--max-request-body-bytes", "0")])
def test_bad_flag_is_a_clean_error(flag, value):
    p = subprocess.run([sys.executable, "-m", "jaxbatch", "serve", flag, value], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert flag in p.stderr and "Traceback" not in p.stderr
