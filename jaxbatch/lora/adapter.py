"""Reading a PEFT LoRA adapter directory into per-matrix, per-layer arrays (host numpy).

PEFT writes `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `...layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]. PEFT is not needed to read them: `safetensors` is.
The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B here, so the device
computes x @ A.T @ B and nothing else. Everything a request could get wrong is a ValueError
before any state changes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

# Hugging Face module name -> our layer matrix (jaxbatch/model/weights.py; ours are [in, out]).
HF_TO_OURS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
              "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config fields that would change the math; refused rather than silently ignored.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}}


@dataclasses.dataclass
class LoRAWeights:
    """One adapter on the host: per matrix name, (A [L, r, in], B [L, r, out]) float32 with the
    scale in B; layers the adapter does not touch are zeros."""
    rank: int
    matrices: dict[str, tuple[np.ndarray, np.ndarray]]


def read_peft_adapter(path: str, shapes: dict[str, tuple[int, int]], num_layers: int,
                      max_rank: int) -> LoRAWeights:
    """`shapes`: our matrix name -> (in, out) of the model, for every matrix an adapter may
    target (jaxbatch/lora/pool.py `target_shapes`)."""
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: no such directory")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise ValueError(f"LoRA adapter {path!r}: {os.path.basename(needed)} is missing")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json unreadable: {e}") from None
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank {rank} exceeds max_lora_rank={max_rank}")
    for field, neutral in _UNSUPPORTED.items():
        if config.get(field) not in (None, neutral):
            raise ValueError(f"LoRA adapter {path!r}: {field}={config[field]!r} is not supported")
    targets = _targets(path, config.get("target_modules"), shapes)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.numpy import load_file
    try:
        tensors = load_file(weights_path)
    except Exception as e:                 # noqa: BLE001 - any corrupt file is the caller's error
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.safetensors unreadable: {e}") from None
    matrices = {ours: (np.zeros((num_layers, rank, shapes[ours][0]), np.float32),
                       np.zeros((num_layers, rank, shapes[ours][1]), np.float32))
                for ours in targets}
    seen = set()
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {key!r}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        ours = HF_TO_OURS.get(module)
        if ours not in matrices:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is for a module outside "
                             f"its target_modules or this model")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} but the model has {num_layers}")
        fan_in, fan_out = shapes[ours]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(value.shape) != want:
            raise ValueError(f"LoRA adapter {path!r}: {key} has shape {tuple(value.shape)}, "
                             f"this model needs {want}")
        a, b = matrices[ours]
        if which == "A":
            a[layer] = value.astype(np.float32)
        else:
            b[layer] = value.astype(np.float32).T * scale                      # [r, out]
        seen.add((layer, module, which))
    unpaired = {(l, mod) for l, mod, w in seen if (l, mod, "B" if w == "A" else "A") not in seen}
    if unpaired:
        raise ValueError(f"LoRA adapter {path!r}: lora_A without lora_B (or the reverse) for "
                         f"{sorted(unpaired)[:3]}")
    return LoRAWeights(rank, matrices)


def _targets(path: str, target_modules, shapes: dict) -> list[str]:
    if isinstance(target_modules, str):
        target_modules = list(HF_TO_OURS) if target_modules == "all-linear" else [target_modules]
    if not target_modules:
        raise ValueError(f"LoRA adapter {path!r}: target_modules is empty")
    out = []
    for module in target_modules:
        ours = HF_TO_OURS.get(module.rsplit(".", 1)[-1])
        if ours is None or ours not in shapes:
            raise ValueError(f"LoRA adapter {path!r}: target module {module!r} is not one this "
                             f"model supports ({', '.join(k for k, v in HF_TO_OURS.items() if v in shapes)})")
        out.append(ours)
    return sorted(set(out))
