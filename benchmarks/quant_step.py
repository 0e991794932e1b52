"""One decode step of the embedded model, float32 against int8 weights, alone (no engine):
forward + logits at --rows rows of full --context, the same float32 KV cache and the xla
attention, the two jitted steps timed alternately so the load of other jobs hits both alike;
median of --reps. What `jaxbatch bench quant` measured beside its capacity and throughput runs.

    python -m benchmarks quant-step [--rows 16] [--context 256] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.decoder import compute_logits
from jaxbatch.worker.model_calls import reference_forward, reference_params
from jaxbatch.model.loader import load_model
from jaxbatch.model.quantize import quantize_params
from jaxbatch.model.rope import inverse_frequencies
from jaxbatch.worker import attention
from jaxbatch.worker.kv_cache import allocate_pool
from pallas_kernels.xla_paged_attention import decode_work_items, num_decode_items

BLOCK_SIZE = 16


def decode_step_ab(params_by_name, cfg, rows, context, reps):
    """Median seconds of one decode step (forward + logits) per params variant, interleaved."""
    pages = context // BLOCK_SIZE
    pool = allocate_pool(cfg, rows * pages + 1, BLOCK_SIZE, jnp.float32)
    tables = np.arange(1, rows * pages + 1, dtype=np.int32).reshape(rows, pages)
    lengths = np.full(rows, context, np.int32)
    items = decode_work_items([(i, list(tables[i]), context) for i in range(rows)], rows,
                              BLOCK_SIZE, num_decode_items(lengths, BLOCK_SIZE))
    meta = tuple(jnp.asarray(a) for a in items) + (jnp.asarray(lengths),)
    attend = attention.get_backend("xla").decode_attend(meta, cfg.head_dim ** -0.5)
    tokens = jnp.ones(rows, jnp.int32)
    positions = jnp.full(rows, context - 1, jnp.int32)
    slots = jnp.asarray(tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1)
    inv_freq = jnp.asarray(inverse_frequencies(cfg))

    @jax.jit
    def step(params, pool):
        hidden, pool = reference_forward(params, cfg, pool, tokens, positions, slots, attend,
                                            inv_freq)
        return compute_logits(reference_params(params), hidden), pool

    times = {name: [] for name in params_by_name}
    for name, params in params_by_name.items():
        jax.block_until_ready(step(params, pool))                 # compile
    for _ in range(reps):
        for name, params in params_by_name.items():
            start = time.perf_counter()
            jax.block_until_ready(step(params, pool))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}



def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks quant-step",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="a multiple of 16")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    loaded = load_model(None, "float32")
    result = decode_step_ab({"float32": loaded.params, "int8": quantize_params(loaded.params)},
                            loaded.config, args.rows, args.context, args.reps)
    print(json.dumps({"rows": args.rows, "context": args.context, "median_ms": result}))
    return result


if __name__ == "__main__":
    main()
