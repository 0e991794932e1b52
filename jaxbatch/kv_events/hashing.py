"""Block hashes exactly as vLLM computes them with `--prefix-caching-hash-algo sha256_cbor`
(vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py), so a router that hashes prompts the
vLLM way finds our blocks:

    hash(block) = sha256(canonical CBOR of (parent hash or NONE_HASH, tuple(token ids),
                                            extra keys or None))
    NONE_HASH   = sha256(canonical CBOR of the seed), the seed being $PYTHONHASHSEED when set,
                  else the fixed "vllm-none-hash"

Extra keys (vLLM tags each with its source): ("lora", name, path) on every block of a LoRA
request, then ("cache_salt", salt) on a salted request's first block.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
INT_HASH_MASK = (1 << 64) - 1


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(seed: str | None = None) -> bytes:
    """The chain's start. Every process (and the router) must derive it from the same seed."""
    return sha256_cbor(none_hash_seed() if seed is None else seed)


def block_extra_keys(index: int, lora_name: str | None, lora_path: str | None,
                     cache_salt: str | None) -> tuple | None:
    keys = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def event_extra_keys(keys: tuple | None) -> tuple | None:
    """What a BlockStored event carries for a block: vLLM publishes the keys untagged (the LoRA
    name, the salt)."""
    return None if keys is None else tuple(key[1] for key in keys)


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None,
                      root: bytes) -> bytes:
    """`root`: NONE_HASH, the parent of a first block."""
    return sha256_cbor((parent or root, tuple(token_ids), extra_keys))


def external_hash(digest: bytes, block_hash_format: str = "int") -> int | bytes:
    """The form published: vLLM's default is the digest's low 64 bits as an unsigned int."""
    if block_hash_format == "bytes":
        return digest
    return int.from_bytes(digest, "big") & INT_HASH_MASK
