"""A corrupted weight cache is converted again instead of failing every start, and the
`<key>.tmpPID` folders a save killed midway leaves behind are removed (issue 26)."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def _largest_file(folder):
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    return max(files, key=os.path.getsize)


def test_corrupt_cache_is_rebuilt_and_orphans_removed(tmp_path, monkeypatch):
    from jaxbatch.model import loader
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path))
    first = loader.load_model(dtype="float32", on_device=False)
    entry = loader._cache_dir(first.source)
    assert not first.from_cache and os.path.isdir(entry)
    with open(_largest_file(os.path.join(entry, "params")), "r+b") as f:
        f.truncate(100)                      # a disk that filled up mid-save, a bad sector
    orphan = entry + ".tmp99999999"          # no such process: a save killed midway
    os.makedirs(os.path.join(orphan, "params"))
    again = loader.load_model(dtype="float32", on_device=False)
    assert not again.from_cache              # converted again, not an error
    assert not os.path.exists(orphan)
    assert loader.load_model(dtype="float32", on_device=False).from_cache   # rebuilt whole
