"""Model families keyed by Hugging Face architecture (`config.json` `architectures[0]`).

A family is a small module of `jaxbatch/model/` with three names:
    ARCHITECTURES                     the HF class names it serves
    config_fields(hf, base) -> dict   ModelConfig fields beyond `config.base_fields`
    layer_weights(reader, cfg, i)     layer i's params dict from the checkpoint (weights.py)
The forward itself is shared (`model/decoder.py` over `model/layers.py`): a family differs by
config fields (norms, windows, RoPE, soft caps, experts), which the decoder reads statically
or scans as per-layer data. To add a family: a module here, its name in `_FAMILY_MODULES`,
and a tiny random checkpoint in tests/model/conftest.py compared against Hugging Face.
Host side: the family modules import numpy only.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from jaxbatch.model.config import ModelConfig, architecture_of, base_fields

_FAMILY_MODULES = ("llama", "qwen3", "gemma", "phi3", "moe")
_FAMILY_PACKAGE = "jaxbatch.model"


def _families() -> dict[str, ModuleType]:
    table = {}
    for name in _FAMILY_MODULES:
        module = importlib.import_module(f"{_FAMILY_PACKAGE}.{name}")
        for arch in module.ARCHITECTURES:
            table[arch] = module
    return table


def supported_architectures() -> tuple[str, ...]:
    return tuple(_families())


def family_for_architecture(arch: str) -> ModuleType:
    table = _families()
    if arch not in table:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(table)}")
    return table[arch]


def family_of(hf: dict[str, Any]) -> ModuleType:
    return family_for_architecture(architecture_of(hf))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A Hugging Face config dict -> ModelConfig: the shared fields, then the family's own.
    An unknown architecture is a ValueError naming it and listing the supported ones."""
    family = family_of(hf)
    fields = base_fields(hf)
    fields.update(family.config_fields(hf, fields))
    return ModelConfig(**fields)
