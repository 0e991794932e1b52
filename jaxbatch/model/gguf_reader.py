"""Reads a GGUF file (llama.cpp's format) into what a Hugging Face checkpoint directory gives:
a config dict and a float32 state dict under HF's tensor names, with numpy and the `gguf`
package only (no torch).

The result matches what transformers' own GGUF reader produces (tests/model/test_gguf_reader.py
compares every tensor), so `config_from_hf` and `params_from_hf_state` treat both sources alike.
The header is parsed here rather than with `gguf.GGUFReader`: that one builds a numpy array per
vocabulary string (~100k for the embedded file's tokens and merges) and took seconds; the
tensor data is a memory map, dequantised by `gguf.quants.dequantize`.

Architectures: llama (Llama, SmolLM2, and Mistral, whose GGUFs llama.cpp writes as llama) and
qwen2. Any other architecture is refused by name before a tensor is read.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct

import numpy as np

# GGUF architecture -> HF class (what `registry.config_from_hf` looks up).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_VERSIONS = (2, 3)              # v1 counted in 32 bits; llama.cpp has written v3 since 2023
_DEFAULT_ALIGNMENT = 32         # the data section's alignment unless general.alignment says
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}            # GGUF value type -> struct code (little-endian)
_STRING, _ARRAY = 8, 9

# Per-layer tensors, `blk.{i}.<gguf>.{weight,bias}` -> `model.layers.{i}.<hf>.{weight,bias}`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # numpy order (ggml lists the fastest-moving dimension first)
    ggml_type: int
    offset: int                 # from the start of the data section


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    path: str
    metadata: dict
    tensors: tuple[TensorInfo, ...]
    data_start: int


class _Cursor:
    """Sequential little-endian reads over the mapped file."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        # Some vocabularies hold byte pieces that are not UTF-8 on their own.
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:    # one unpack for the whole array (token types: 49k)
                code = _SCALARS[item_type]
                values = list(struct.unpack_from(f"<{count}{code}", self.buf, self.pos))
                self.pos += count * struct.calcsize(code)
                return values
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")


def read_header(path: str) -> GGUFHeader:
    """Metadata (every key, arrays as lists) and the tensor table; no tensor data is read."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:      # magic, version, two counts
            raise ValueError(f"{path} is not a GGUF file (too short for a GGUF header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
            cur = _Cursor(buf, path)
            cur.pos = 4
            version = cur.scalar("I")
            if version not in _VERSIONS:
                raise ValueError(f"{path} is GGUF version {version}; readable: {_VERSIONS}")
            n_tensors, n_keys = cur.scalar("Q"), cur.scalar("Q")
            metadata = {}
            for _ in range(n_keys):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar("I"))
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
                ggml_type, offset = cur.scalar("I"), cur.scalar("Q")
                tensors.append(TensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
            align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
            data_start = (cur.pos + align - 1) // align * align
    return GGUFHeader(path, metadata, tuple(tensors), data_start)


def _architecture(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {header.path} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_config_of(header: GGUFHeader) -> dict:
    """The HF config dict, from llama.cpp's `<arch>.*` and `tokenizer.ggml.*` keys (the names
    transformers maps them to)."""
    md, arch = header.metadata, _architecture(header)
    key = lambda name, default=None: md.get(f"{arch}.{name}", default)   # noqa: E731
    scaling = key("rope.scaling.type")
    names = {t.name for t in header.tensors}
    # Llama 3.x files carry their RoPE scaling as a `rope_freqs` tensor without its parameters,
    # and transformers' reader dropped any scaling: refused rather than run with wrong RoPE.
    if (scaling not in (None, "none")) or "rope_freqs.weight" in names:
        raise ValueError(f"{header.path} uses RoPE scaling ({scaling or 'rope_freqs tensor'}), "
                         f"which the GGUF reader does not convert; use the HF checkpoint")
    heads = key("attention.head_count")
    tokens = md.get("tokenizer.ggml.tokens")
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        # Older files state no vocab_size: the vocabulary's length is it.
        "vocab_size": key("vocab_size", len(tokens) if tokens is not None else None),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": md.get("tokenizer.ggml.unknown_token_id"),
    }
    if arch == "llama":
        # The rotary width is the head size for llama (transformers reads head_dim from it).
        if key("rope.dimension_count") is not None:
            hf["head_dim"] = key("rope.dimension_count")
        hf["attention_bias"] = "blk.0.attn_q.bias" in names
    missing = [k for k, v in hf.items() if v is None and not k.endswith("token_id")]
    if missing:
        raise ValueError(f"{header.path} lacks the metadata for {', '.join(missing)}")
    return hf


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order. HF's rotary embedding rotates dimension j of a head
    with j + head_dim/2 (rotate_half); llama.cpp's rotates neighbours 2j and 2j+1, so its
    converter interleaved each head's two halves. Reversed here: per head, rows (j, 2) ->
    (2, j). Applies to biases too (1-D)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _dequantize(data: np.memmap, header: GGUFHeader, info: TensorInfo) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"{header.path}: tensor {info.name} has unknown ggml type "
                         f"{info.ggml_type}") from None
    # Rows are stored whole blocks at a time: (..., n) values -> (..., n / block * bytes).
    byte_shape = (*info.shape[:-1], info.shape[-1] // block * block_bytes)
    start = header.data_start + info.offset
    raw = data[start:start + int(np.prod(byte_shape))].reshape(byte_shape)
    try:
        values = dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ValueError(f"{header.path}: tensor {info.name}: {e}") from None
    # A copy, always: F32 tensors come back as views of the read-only file mapping.
    return np.array(values, dtype=np.float32).reshape(info.shape)


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(hf_config, {HF tensor name: float32 array}). A tied lm_head is not duplicated (HF's
    state_dict lists it; the params builder reads the embedding for it)."""
    header = read_header(path)
    hf = hf_config_of(header)
    unknown = [t.name for t in header.tensors if _hf_name(t.name) is None]
    if unknown:
        raise ValueError(f"{path} holds tensors the GGUF reader does not map: {unknown[:5]}")
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    data = np.memmap(path, mode="r", dtype=np.uint8)
    state = {}
    for info in header.tensors:
        w = _dequantize(data, header, info)
        m = _LAYER_TENSOR.fullmatch(info.name)
        # Only llama's converter permutes q/k (qwen2 keeps HF's order).
        if hf["model_type"] == "llama" and m and m.group(2) in heads:
            w = _unpermute_rope_rows(w, heads[m.group(2)])
        state[_hf_name(info.name)] = w
    return hf, state
