"""Embeddings (runner="pooling"): tiny random Llama / Qwen3 / Gemma 3 checkpoints pooled as
their sentence-transformers files say equal Hugging Face's last hidden state pooled the same
way; a request alone equals it in a batch; a prompt longer than a chunk pools across chunks;
KV is freed at once; Matryoshka `dimensions` where the checkpoint allows it, a ValueError
elsewhere; the two runners refuse each other's requests and runners."""
from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.pooling_params import PoolingParams
from embedding_models import hf_embedding, write_embedding_checkpoint

# A budget of several chunks: a batch packs chunks of different requests into one call (a
# chunk's pooling must not reach into its neighbour's rows).
ENGINE = dict(runner="pooling", dtype="float32", max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=160, prefill_chunk_size=32, warmup=False,
              compilation_cache=False)
# 1 token (never a decode), under a chunk, several chunks (pooled across them).
LENGTHS = (1, 7, 32, 45, 100)


def prompts(seed: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("family, pooling, normalize", [
    ("llama", None, True),         # no sentence-transformers files: last token, normalized
    ("qwen3", "mean", False),
    ("gemma3", "cls", True),
])
def test_embeddings_equal_hugging_face_pooled_and_solo_equals_batched(tmp_path, family,
                                                                       pooling, normalize):
    model = write_embedding_checkpoint(family, str(tmp_path), pooling, normalize, seed=1)
    llm = LLM(str(tmp_path), **ENGINE)
    batch = prompts()
    outs = llm.embed(batch, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        ref = hf_embedding(model, prompt, pooling or "last", normalize)
        got = np.asarray(out.outputs.embedding)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        assert out.prompt_token_ids == prompt and out.finished
    solo = [llm.embed(p, use_tqdm=False)[0].outputs.embedding for p in batch]
    assert solo == [o.outputs.embedding for o in outs]          # bit for bit
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0


def test_pooling_flags_override_the_checkpoint_and_nothing_compiles_after_warmup(tmp_path):
    model = write_embedding_checkpoint("qwen3", str(tmp_path), "cls", normalize=True, seed=2)
    llm = LLM(str(tmp_path), **{**ENGINE, "warmup": True, "max_num_seqs": 2},
              pooling_type="mean", pooling_normalize=False)
    batch = prompts(4)
    outs = llm.embed(batch, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        np.testing.assert_allclose(out.outputs.embedding, hf_embedding(model, prompt, "mean", False),
                                   rtol=1e-4, atol=1e-5)
    assert llm.llm_engine.stats()["num_compilations_after_warmup"] == 0


def test_matryoshka_dimensions_where_the_checkpoint_lists_them(tmp_path):
    model = write_embedding_checkpoint("llama", str(tmp_path / "m"), matryoshka=[16, 32], seed=3)
    llm = LLM(str(tmp_path / "m"), **ENGINE)
    prompt = prompts()[3]
    out = llm.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)[0]
    np.testing.assert_allclose(out.outputs.embedding, hf_embedding(model, prompt, "last", True, 16),
                               rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions=20 must be one of"):
        llm.embed(prompt, PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    shapes = {k: v for k, v in ENGINE.items() if k != "runner"}
    with pytest.raises(ValueError, match="belongs to a pooling engine"):
        LLMEngine(loaded=llm.llm_engine.loaded, runner=llm.llm_engine.runner, **shapes)

    write_embedding_checkpoint("llama", str(tmp_path / "plain"), seed=3)
    plain = LLM(str(tmp_path / "plain"), **ENGINE)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        plain.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)
    generating = LLM(str(tmp_path / "plain"), **{**ENGINE, "runner": "generate"})
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.embed(prompt, use_tqdm=False)
