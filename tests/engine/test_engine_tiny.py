"""The engine on tiny random models of each supported variant: greedy equality with Hugging
Face for 32 steps, and the attention backends agreeing (no compilation after warm-up: see
test_compilation.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxbatch import SamplingParams
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.loader import LoadedModel
from engines import Close, result, run_all, tiny_engine
from tiny_models import VARIANTS, make_hf_model, ours_from_hf, random_token_prompts


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_variant_greedy_matches_hugging_face(variant):
    model = make_hf_model(variant, seed=1)
    engine = tiny_engine(model, max_num_seqs=3)
    prompts = random_token_prompts(np.random.default_rng(5), [3, 17, 40, 90])
    n = 32
    outs = run_all(engine, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)] * 4)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, variant


def test_backends_agree_and_a_step_packs_its_prefill_chunks_into_one_call():
    """xla (work lists, query tiles), reference (block tables, ragged oracle) and the Pallas
    kernels in interpret mode lay the same plans out differently; the tokens must agree. The
    second step admits three prompts, whose chunks share one prefill call (xla, Pallas), which
    on xla also carries the first prompt's decode row."""
    model = make_hf_model("llama_untied_gqa2", seed=3)
    prompts = random_token_prompts(np.random.default_rng(9), [5, 30, 70, 12, 44, 3])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (9, 3, 14, 6, 11, 8)]
    tokens = {}
    for backend in ("xla", "reference", "pallas_interpret"):
        engine = tiny_engine(model, max_num_seqs=4, prefill_chunk_size=32,
                             max_num_batched_tokens=128, attention_backend=backend)
        calls = []
        dispatch = engine.runner._dispatch
        engine.runner._dispatch = lambda call, *rest: calls.append(call.key) or dispatch(call, *rest)
        engine.add_request("first", prompts[0], params[0])
        engine.step()
        assert [k[0] for k in calls] == ["prefill"]
        for i in range(1, 4):
            engine.add_request(str(i), prompts[i], params[i])
        calls.clear()
        engine.step()
        # The oracle's ragged attention costs tokens x chunks x context: it takes one per call.
        # xla runs the decode rows inside the prefill call (unified_step, on by default).
        one_call_each = backend == "reference"
        expected = (["mixed"] if backend == "xla" else
                    ["prefill"] * (3 if one_call_each else 1) + ["decode"])
        assert [k[0] for k in calls] == expected
        for i in range(4, len(prompts)):
            engine.add_request(str(i), prompts[i], params[i])
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert len(done) == len(prompts)
        tokens[backend] = done
    assert tokens["reference"] == tokens["xla"]
    assert tokens["pallas_interpret"] == tokens["xla"]


def test_per_layer_weight_layout_gives_the_same_tokens():
    """The two ways the layer scan reaches its matrices (model/decoder.py, the engine's
    weight_layout) are the same model."""
    from jaxbatch.model.decoder import stack_layers
    from jaxbatch.model.linear import PerLayer
    cfg, params = ours_from_hf(make_hf_model("llama_gqa4_bias", seed=4))
    prompts = random_token_prompts(np.random.default_rng(11), [4, 33, 70])
    sp = [SamplingParams(temperature=t, seed=3, max_tokens=12, ignore_eos=True)
          for t in (0.0, 0.0, 0.9)]
    tokens = []
    for per_layer in (False, True):
        layered = stack_layers(params, matrices_per_layer=not per_layer)   # the engine re-forms
        loaded = LoadedModel(cfg, layered, tokenizer=None, source="tiny", load_seconds=0.0,
                             from_cache=False)
        engine = LLMEngine(loaded=loaded, max_num_seqs=2, max_model_len=128, warmup=False,
                           compilation_cache=False,
                           weight_layout="per_layer" if per_layer else "stacked")
        assert isinstance(engine.runner.params["layers"]["wo"], PerLayer) == per_layer
        tokens.append([o.outputs[0].token_ids for o in run_all(engine, prompts, sp)])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_unified_step_gives_the_outputs_of_separate_calls(kv_cache_dtype):
    """Prompts admitted while others decode: with unified_step those steps run one ("mixed",
    ...) call; every token is the same as with a decode call and a prefill call, and every
    logprob and prompt logprob within LOGPROB_TOL. Not bit for bit: on this tiny model's
    float32 dots XLA:CPU rounds a row's last bit differently for another row count; the
    embedded model's batch invariance, mixed steps included, is held bit for bit by
    tests/model/test_bf16_batch_invariance.py and test_engine.py's test_batch_invariance."""
    model = make_hf_model("llama_untied_gqa2", seed=4)
    prompts = random_token_prompts(np.random.default_rng(11), [5, 30, 70, 12, 44, 3, 21])
    params = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=n,
                             ignore_eos=True, logprobs=2, prompt_logprobs=1 if i == 4 else None)
              for i, n in enumerate((9, 3, 14, 6, 11, 8, 5))]
    results, kinds = {}, {}
    shape = dict(max_num_seqs=4, prefill_chunk_size=32, max_num_batched_tokens=64,
                 kv_cache_dtype=kv_cache_dtype)
    for unified in (True, False):
        engine = tiny_engine(model, unified_step=unified, **shape)
        seen = set()
        dispatch = engine.runner._dispatch
        engine.runner._dispatch = lambda call, *rest: seen.add(call.key[0]) or dispatch(call, *rest)
        outs = run_all(engine, prompts, params)
        results[unified] = [result(o) + [Close(o.prompt_logprobs and o.prompt_logprobs[1:])]
                            for o in outs]
        kinds[unified] = seen
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert "mixed" in kinds[True] and "mixed" not in kinds[False]
    assert results[True] == results[False]
    # A shared runner's compiled calls are laid out one way: the other is refused.
    with pytest.raises(ValueError, match="unified_step"):
        LLMEngine(loaded=engine.loaded, runner=engine.runner, max_model_len=256, warmup=False,
                  compilation_cache=False, unified_step=True, **shape)
