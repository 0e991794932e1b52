"""Run by test_moe_tensor_parallel.py in a subprocess that sees 4 virtual CPU devices: one
MoE checkpoint (argv[1]) on one device and under tensor_parallel_size argv[2] must give the
same tokens and logprobs, with the experts split over the mesh (not replicated)."""
from __future__ import annotations

import sys

import numpy as np

from jaxbatch import LLM, SamplingParams

folder, size = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 19, 40)]
params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
results = {}
for tp in (1, size):
    llm = LLM(model=folder, dtype="float32", max_num_seqs=2, max_model_len=128,
              prefill_chunk_size=16, warmup=False, compilation_cache=False,
              tensor_parallel_size=tp)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = np.array([[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs])
    results[tp] = (tokens, logprobs)
    if tp > 1:
        we_gate = llm.llm_engine.runner.params["layers"]["we_gate"].w           # [L, E, d, F]
        shard = we_gate.addressable_shards[0].data.shape
        assert shard[1] == we_gate.shape[1] // tp, f"experts not split: shard {shard}"
    print(f"tp={tp} tokens={tokens}")
for tp in (size,):
    assert results[tp][0] == results[1][0], f"tp={tp} tokens differ from one device"
    err = np.abs(results[tp][1] - results[1][1]).max()
    assert err < 1e-4, f"tp={tp} logprobs differ by {err}"
    print(f"tp={tp} max |dlogprob| vs one device {err:.2e}")
