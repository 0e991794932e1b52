"""The LoRA batch delta of one d x d matrix in its two forms, beside the base matmul (jit, mean
of 50): the one-hot einsum the model uses, and per-row gathers of each row's A and B. Why the
model takes the one-hot form.

    python -m benchmarks lora-delta [--rows 16 256]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def delta_forms_ms(rows: int, d: int = 576, slots: int = 5, r: int = 16) -> dict[str, float]:
    """The batch delta of one d x d matrix both ways (jit, mean of 50), beside the base matmul:
    the one-hot einsum the model uses, and per-row gathers of each row's A and B."""
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

    def mean_ms(fn, *xs, reps=50):
        jax.block_until_ready(fn(*xs))
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*xs)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / reps * 1e3
    return {"base matmul": mean_ms(jax.jit(lambda x, w: x @ w), x, w),
            "one-hot einsum": mean_ms(jax.jit(lora_delta), x, a, b, one_hot),
            "per-row gather": mean_ms(jax.jit(lora_delta_gathered), x, a, b, idx)}



def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks lora-delta",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args(argv)
    deltas = {rows: delta_forms_ms(rows) for rows in args.rows}
    for rows, forms in deltas.items():
        print(f"delta, {rows} rows x 576^2, 5 slots, r 16: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in forms.items()), flush=True)
    return deltas


if __name__ == "__main__":
    main()
