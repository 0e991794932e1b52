"""Block hashes as vLLM computes them with sha256_cbor: the golden values below were computed
by vLLM 0.32 itself (vllm.v1.core.kv_cache_utils.hash_block_tokens after init_none_hash(
sha256_cbor), PYTHONHASHSEED unset unless said), and the chain is recomputed here from the
definition (sha256 over canonical CBOR) without jaxbatch's helpers."""
from __future__ import annotations

import hashlib

import cbor2
import pytest

from jaxbatch.kv_events import hashing

# vLLM 0.32: NONE_HASH, then blocks tokens 0..15 and 16..31, published as ints (low 64 bits).
VLLM_NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_PLAIN = [2233398808101521225, 17911472383915781900]
# The same two blocks of a request with LoRA adapter "sql" (path /adapters/sql) and
# cache_salt "tenant-a"; vLLM's event extra keys for them.
VLLM_LORA_SALTED = [13356963957394905370, 14939584957426967751]
VLLM_EVENT_EXTRA_KEYS = [("sql", "tenant-a"), ("sql",)]
# PYTHONHASHSEED=42: the first block.
VLLM_SEED_42_FIRST = 2863503375995570957


def definition(parent: bytes, tokens, extra) -> bytes:
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()


def chain(root: bytes, extras=(None, None)) -> list[bytes]:
    out, parent = [], root
    for i, extra in enumerate(extras):
        parent = hashing.hash_block_tokens(None if i == 0 else parent,
                                           range(16 * i, 16 * (i + 1)), extra, root)
        out.append(parent)
    return out


def test_none_hash_comes_from_the_fixed_seed_or_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hashing.none_hash().hex() == VLLM_NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    root = hashing.none_hash()
    assert root == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()
    assert hashing.external_hash(chain(root)[0]) == VLLM_SEED_42_FIRST


def test_plain_chain_equals_vllms(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    root = hashing.none_hash()
    digests = chain(root)
    assert [hashing.external_hash(d) for d in digests] == VLLM_PLAIN
    assert digests[0] == definition(root, range(16), None)
    assert digests[1] == definition(digests[0], range(16, 32), None)
    # "bytes": the whole digest; "int": its low 64 bits, unsigned.
    assert hashing.external_hash(digests[1], "bytes") == digests[1]
    assert hashing.external_hash(digests[1]) == int.from_bytes(digests[1][-8:], "big")


def test_lora_and_salt_extra_keys_equal_vllms(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extras = [hashing.block_extra_keys(i, "sql", "/adapters/sql", "tenant-a") for i in (0, 1)]
    assert extras == [(("lora", "sql", "/adapters/sql"), ("cache_salt", "tenant-a")),
                      (("lora", "sql", "/adapters/sql"),)]
    digests = chain(hashing.none_hash(), extras)
    assert [hashing.external_hash(d) for d in digests] == VLLM_LORA_SALTED
    assert [hashing.event_extra_keys(e) for e in extras] == VLLM_EVENT_EXTRA_KEYS
    # An empty salt is no salt (vLLM keys the salt only when it is truthy).
    assert hashing.block_extra_keys(0, None, None, "") is None


@pytest.mark.parametrize("fmt", ["int", "bytes"])
def test_hash_forms(fmt):
    digest = bytes(range(32))
    out = hashing.external_hash(digest, fmt)
    assert out == (digest if fmt == "bytes" else int.from_bytes(digest[24:], "big"))
