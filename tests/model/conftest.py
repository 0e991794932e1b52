"""Tiny random checkpoints of every family, written once per session into a temporary
directory (no download: transformers builds each from its config)."""
from __future__ import annotations

import os

import pytest

from families import write_checkpoint
from kernel_cache import cache_sharing_kernels


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (directory, the Hugging Face model it was saved from)."""
    root = tmp_path_factory.mktemp("families")
    # The loader caches converted params: keep that cache inside the session's tmp dir (it
    # stays set for the rest of the session: later processes share the built kernels).
    os.environ["JAXBATCH_CACHE"] = cache_sharing_kernels(str(root / "cache"))
    made = {}

    def get(name):
        if name not in made:
            folder = str(root / name)
            made[name] = (folder, write_checkpoint(name, folder))
        return made[name]
    return get
