"""What a checkpoint says about its embeddings, read from the files sentence-transformers
writes beside the weights: `modules.json` lists the pipeline (a Pooling module and, for
models that normalize, a Normalize module), the Pooling module's `config.json` names the
pooling mode; `config.json` may list Matryoshka dimensions (`matryoshka_dimensions`, or
`is_matryoshka`). Plain file reads, no sentence-transformers import."""
from __future__ import annotations

import dataclasses
import json
import os

# sentence-transformers' Pooling config keys -> our pooling types
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}


@dataclasses.dataclass(frozen=True)
class CheckpointPooling:
    """None: the checkpoint does not say."""
    pooling_type: str | None = None
    normalize: bool | None = None
    # () none; None any truncation (is_matryoshka without a list); else the list
    matryoshka_dimensions: tuple[int, ...] | None = ()


def read_pooling(source: str) -> CheckpointPooling:
    """`source`: a checkpoint directory (a GGUF file says nothing: all None)."""
    if not os.path.isdir(source):
        return CheckpointPooling()
    modules = _read_json(os.path.join(source, "modules.json")) or []
    pooling_type = normalize = None
    if modules:
        normalize = False
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith("Normalize"):
                normalize = True
            elif kind.endswith("Pooling"):
                pooling_type = _pooling_mode(os.path.join(source, module.get("path", ""),
                                                          "config.json"))
    config = _read_json(os.path.join(source, "config.json")) or {}
    dims = config.get("matryoshka_dimensions")
    if dims:
        matryoshka = tuple(int(d) for d in dims)
    else:
        matryoshka = None if config.get("is_matryoshka") else ()
    return CheckpointPooling(pooling_type, normalize, matryoshka)


def _pooling_mode(path: str) -> str | None:
    config = _read_json(path) or {}
    modes = [ours for key, ours in _MODES.items() if config.get(key)]
    if len(modes) > 1 or any(v for k, v in config.items()
                             if k.startswith("pooling_mode_") and k not in _MODES):
        raise ValueError(f"{path}: pooling mode {config} is not one of last token, mean, CLS")
    return modes[0] if modes else None


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
