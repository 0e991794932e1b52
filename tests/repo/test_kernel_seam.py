"""The model and the attention backends never name a kernel: every choice of what runs an
operation is the kernel seam's (jaxbatch/worker/kernels.py), made once per engine."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROOMS = ("jaxbatch/model", "jaxbatch/worker/attention")
# What only the seam may name: the C++ kernels, their gates, platform switches, storage forms,
# and environment switches (every one is an EngineConfig field).
FORBIDDEN = re.compile(r"cpu_kernels|why_not|platform_dependent|PACKED|os\.environ|getenv"
                       r"|JAXBATCH_[A-Z_]+")


def offenders(rooms=ROOMS) -> list[str]:
    found = []
    for room in rooms:
        for path in sorted((ROOT / room).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if FORBIDDEN.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_the_model_and_attention_rooms_name_no_kernel_gate_platform_or_environment():
    assert offenders() == []


def test_the_check_finds_a_kernel_named_in_the_model(tmp_path, monkeypatch):
    room = tmp_path / "jaxbatch" / "model"
    room.mkdir(parents=True)
    (room / "layer.py").write_text("from cpu_kernels import packed_gemm\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path, raising=False)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert offenders(("jaxbatch/model",)) == [
            "jaxbatch/model/layer.py:1: from cpu_kernels import packed_gemm"]
    finally:
        ROOT = saved
