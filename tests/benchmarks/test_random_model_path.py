"""A random-weight model of a real shape takes the path a user's checkpoint of that shape
takes: the random `small` shape (the embedded model's) gets the embedded model's kernels and
the same weight forms, leaf for leaf, so a roofline or throughput figure on a random `1B` or
`8B` is the figure a user's checkpoint would give."""
from __future__ import annotations

import jax

from jaxbatch.benchmarks.random_models import random_model
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.worker.weight_forms import is_linear_leaf


def _engine(**kw):
    return LLMEngine(max_num_seqs=4, max_model_len=256, warmup=False, compilation_cache=False,
                     dtype="bfloat16", **kw)


def _forms(engine):
    """Every weight leaf as (its typed form or array type, shape, dtype), in tree order."""
    leaves, tree = jax.tree.flatten(engine.runner.params, is_leaf=is_linear_leaf)
    described = [(type(leaf).__name__,
                  tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(leaf)))
                 for leaf in leaves]
    return tree, described


def test_random_small_takes_the_embedded_models_kernels_and_weight_forms():
    embedded = _engine()
    random_small = _engine(loaded=random_model("small", "bfloat16"))
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "tie_word_embeddings", "rope_theta")
    assert ({f: getattr(random_small.model_config, f) for f in shape}
            == {f: getattr(embedded.model_config, f) for f in shape})
    assert random_small.stats()["kernels"] == embedded.stats()["kernels"]
    assert _forms(random_small) == _forms(embedded)
