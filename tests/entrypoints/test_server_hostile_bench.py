"""A tiny smoke run of the hostile-client benchmark (jaxbatch/benchmarks/hostile.py) against
one server: every case answers, the server keeps serving, the signals case ends every stream
with [DONE] and the process exits 0."""
from __future__ import annotations

import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.slow


def test_hostile_bench_tiny(capsys):
    from benchmarks import hostile
    srv = ServerProcess("--max-num-seqs", "8", "--max-model-len", "512", "--no-warmup",
                        "--max-num-queued-reqs", "64", "--timeout-header-read", "2")
    try:
        srv.wait_ready()
        rows = hostile.run(["--base", srv.base, "--pid", str(srv.proc.pid), "--tiny"])
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    by = {r["case"].split(":")[0]: r for r in rows}
    zoo = [r for r in rows if r["case"].startswith("zoo")]
    assert len(zoo) == len(hostile.ZOO)
    assert all(isinstance(r["status"], int) and 400 <= r["status"] < 500 for r in zoo), zoo
    assert all(r["seconds"] < 10 for r in zoo), zoo
    assert all(r["still_serving"] for r in rows if not r["case"].startswith("signals")), rows
    assert by["slowloris"]["status"] == "closed 6/6"
    assert by["saturation"]["status"] == "200x8"
    assert by["disconnect"]["status"] == "idle"
    assert by["signals"]["status"].startswith("[DONE] 4/4"), by["signals"]
    assert code == 0
    assert "case" in capsys.readouterr().out       # the table was printed
