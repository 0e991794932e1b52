"""Indicative LoRA costs (not a test; numbers in tests/lora/README.md). CPU, both forms of the
batch delta, then decode steps of a small random Llama at 16 rows with 0, 1 and max_loras
adapters active against the same engine without LoRA:
    PYTHONPATH=$PWD python tests/lora/measure_lora.py
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]


def time_fn(fn, *args, reps=50):
    import jax
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def delta_forms(rows, d=576, slots=5, r=16):
    import jax
    import jax.numpy as jnp
    from jaxbatch.model.lora_delta import lora_delta, lora_delta_gathered
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((slots, r, d)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((slots, r, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, slots, rows), jnp.int32)
    one_hot = jax.nn.one_hot(idx, slots, dtype=jnp.float32)
    return (time_fn(jax.jit(lambda x, w: x @ w), x, w),
            time_fn(jax.jit(lora_delta), x, a, b, one_hot),
            time_fn(jax.jit(lora_delta_gathered), x, a, b, idx))


def decode_steps(engine, lora_requests, rows=16, tokens=48):
    from jaxbatch import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(rows):
        lr = lora_requests[i % len(lora_requests)] if lora_requests else None
        kw = {} if lr is None else {"lora_request": lr}
        engine.add_request(f"m{engine.num_steps}-{i}", [5 + i, 6, 7, 8], sp, **kw)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times[4:-2])) * 1e3        # decode-only steps


def main():
    for rows in (16, 256):
        base, one_hot, gathered = delta_forms(rows)
        print(f"delta at {rows} rows x 576^2, 5 slots, r 16: base matmul {base:.3f} ms, "
              f"one-hot {one_hot:.3f} ms, gather {gathered:.3f} ms")
    import torch
    import transformers
    from adapters import write_adapter
    from jaxbatch import LoRARequest
    from jaxbatch.engine.llm_engine import LLMEngine
    from jaxbatch.model.loader import LoadedModel
    from tiny_models import ours_from_hf
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    root = tempfile.mkdtemp()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    requests = []
    for i in range(4):
        write_adapter(model, f"{root}/{i}", 16, targets, seed=i)
        requests.append(LoRARequest(f"l{i}", i + 1, f"{root}/{i}"))
    cfg, params = ours_from_hf(model)
    loaded = LoadedModel(cfg, params, tokenizer=None, source="m", load_seconds=0.0, from_cache=False)
    common = dict(max_model_len=128, max_num_seqs=16, compilation_cache=False)
    plain = LLMEngine(loaded=loaded, **common)
    lora = LLMEngine(loaded=loaded, enable_lora=True, max_loras=4, max_lora_rank=16, **common)
    # Interleaved, twice: the machine is shared, so neighbours' load moves every number.
    for _ in range(2):
        print(f"decode step, 16 rows, no LoRA engine: {decode_steps(plain, []):.2f} ms")
        for name, active in (("0 adapters", []), ("1 adapter", requests[:1]),
                             ("4 adapters", requests)):
            print(f"decode step, 16 rows, LoRA engine, {name}: {decode_steps(lora, active):.2f} ms")


if __name__ == "__main__":
    main()
