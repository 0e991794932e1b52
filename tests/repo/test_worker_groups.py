"""The suite runs on two pytest-xdist workers (`scripts/bootstrap.py test`), a file to a worker;
the files that start a Ray cluster share one worker, one after another (pyproject's
`one_worker_paths`, grouped by tests/conftest.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTS_A_CLUSTER = re.compile(r"\bcluster_utils\b|\bray\.init\(|\bray start\b")


def test_every_file_that_starts_a_ray_cluster_runs_on_the_one_worker(pytestconfig):
    starts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if p != Path(__file__).resolve() and STARTS_A_CLUSTER.search(p.read_text())}
    assert starts, "no test starts a Ray cluster: the pattern no longer finds them"
    missing = starts - set(pytestconfig.getini("one_worker_paths"))
    assert not missing, f"start a Ray cluster but may run beside another one: {sorted(missing)}"


def test_under_xdist_a_test_is_grouped_by_its_file(request, pytestconfig):
    if not pytestconfig.pluginmanager.hasplugin("xdist"):
        pytest.skip("pytest-xdist is not installed")
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args[0] == "tests/repo/test_worker_groups.py"
