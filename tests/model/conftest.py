"""Tiny random checkpoints of every family, written once per session into a temporary
directory (no download: transformers builds each from its config)."""
from __future__ import annotations

import os

import pytest

from families import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (directory, the Hugging Face model it was saved from)."""
    root = tmp_path_factory.mktemp("families")
    # The loader caches converted params: keep that cache inside the session's tmp dir.
    os.environ["JAXBATCH_CACHE"] = str(root / "cache")
    made = {}

    def get(name):
        if name not in made:
            folder = str(root / name)
            made[name] = (folder, write_checkpoint(name, folder))
        return made[name]
    return get
