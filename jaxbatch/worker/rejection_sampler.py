"""The standard rejection step of speculative sampling (Leviathan et al. 2023, Chen et al. 2023),
for a proposed token d drawn from a draft distribution q, verified against the target's p.

Output d with probability min(1, p(d) / q(d)); otherwise a sample of the normalised residual
max(p - q, 0). Whatever q is, the output is distributed exactly as p. A rejected d has
p(d) < q(d), so the residual gives it no mass: the output equals d exactly when d was accepted,
which is the rule the scheduler already applies ("accept while the draft equals the sample").

Pure jnp, no state: the sampler (jaxbatch/worker/sampler.py) supplies u and the Gumbel noise from the
row's (seed, position) keys, so a row draws the same noise alone or in any batch.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxbatch.worker.argmax import two_level_argmax


def rejection_sample(p, q, draft, u, gumbel, argmax=two_level_argmax):
    """p, q [N, V] f32 (rows sum to 1); draft [N] i32, drawn from q; u [N] f32 uniform in
    [0, 1); gumbel [N, V] f32 standard Gumbel noise -> tokens [N] i32, each distributed as p."""
    p_d = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]                 # [N]
    q_d = jnp.take_along_axis(q, draft[:, None], axis=-1)[:, 0]                 # [N]
    # u < p/q without dividing: a q(d) that underflowed to 0 accepts (if p(d) > 0).
    accept = u * q_d < p_d
    residual = jnp.maximum(p - q, 0.0)                                          # [N, V]
    # Where p and q agree to within rounding the residual can vanish; p is then its limit.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
    # Gumbel-max on log weights samples the normalised weights; log(0) = -inf is never chosen.
    resampled = argmax(jnp.log(residual) + gumbel)
    return jnp.where(accept, draft, resampled).astype(jnp.int32)
