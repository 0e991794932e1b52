"""Shared fixtures: the embedded model is loaded once per session, its Hugging Face twin too."""
from __future__ import annotations

import os

import pytest

# Two CI cores: keep XLA and torch from oversubscribing them.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


@pytest.fixture(scope="session")
def embedded():
    from jaxbatch.model.loader import load_model
    return load_model(dtype="float32")


@pytest.fixture(scope="session")
def hf_embedded():
    import torch
    from transformers import AutoModelForCausalLM
    from jaxbatch.model.loader import embedded_gguf_path
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def long_prompt_ids(embedded):
    """~500 tokens of real text: short prompts hide RoPE bugs."""
    text = " ".join(
        f"Chapter {i}. The river that crosses the old city carried barges of grain, wine and "
        f"timber; merchants in the {i}th district argued about tolls, bridges and the weather."
        for i in range(1, 40))
    ids = embedded.tokenizer(text)["input_ids"]
    assert len(ids) >= 500
    return ids[:500]


# --- the short loop: `pytest -m "not slow and not e2e"` ------------------------------------------
# pyproject.toml's `e2e_paths` names the files, folders and single tests (file::name) that run
# engines end to end (servers, multi-device engines, the benchmarks' runs, the longest model
# comparisons); their tests get the `e2e` marker, so the selection lives in one list.

def pytest_addoption(parser):
    parser.addini("e2e_paths", "test files, folders or file::test names marked e2e (left out "
                  "of the short loop)", type="linelist", default=[])
    parser.addini("one_worker_paths", "test files that pytest-xdist runs on one worker, one "
                  "after another", type="linelist", default=[])


# Before xdist's own hook, which reads the groups into the test ids it schedules by.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    entries = config.getini("e2e_paths")
    paths = [config.rootpath / p for p in entries if "::" not in p]
    tests = {p for p in entries if "::" in p}
    for item in items:
        if (item.nodeid.split("[")[0] in tests
                or any(item.path == p or p in item.path.parents for p in paths)):
            item.add_marker(pytest.mark.e2e)
    if config.pluginmanager.hasplugin("xdist"):
        # `--dist loadgroup`: a file is a group (a worker builds its module fixtures once),
        # except the files of `one_worker_paths`, which are one group between them
        shared = {config.rootpath / p for p in config.getini("one_worker_paths")}
        for item in items:
            group = ("one worker" if item.path in shared
                     else item.path.relative_to(config.rootpath).as_posix())
            item.add_marker(pytest.mark.xdist_group(group))
