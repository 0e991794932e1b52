"""One decode step of the engine against its floor, with a breakdown of where the time goes.

    jaxbatch bench decode-floor [--slots 32] [--contexts 128 512] [--out bench_out]

The floor is what no engine design can beat on this machine: the same model's dense matmuls
plus a dense, unpaged attention over the same contexts (a contiguous [B, ctx] KV cache per
layer, written in place), greedy argmax, one jitted call on device arrays, no host work.

The engine step is a real `LLMEngine.step()` in steady-state decode: `slots` requests, every
slot decoding, every length inside (ctx/2, ctx]. The engine's attention (the `xla` backend on
CPU) reads each slot's own pages; the floor's dense attention computes over all ctx positions
of its cache, masked to each length.

Timing: rounds interleave one engine step with one call of each piece below (jitted, device-
synchronised, on the inputs of the engine's own decode step), so a slow moment caused by other
jobs on the machine hits all of them alike; figures are medians over rounds.
  matmuls    dense forward with attention replaced by the identity (norms, RoPE, projections,
             MLP, logits, argmax): the matmul floor
  attention  floor - matmuls: dense attention over the contexts
  paging     engine forward with paged KV (write through slot mapping, gather pages) - floor
  sampling   the engine's two compiled calls of a decode step (model call, then the sampler:
             greedy/random branch, the token's logprob; no top-k, as no request asks for
             logprobs) - the same paged forward ending in a plain argmax
  host       engine.step() wall time - the compiled executable: building the step's arrays,
             dispatch, reading tokens back, scheduler planning and update, outputs
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch import SamplingParams
from jaxbatch.benchmarks.observer import LastPlan, observe
from jaxbatch.benchmarks.report import table
from jaxbatch.worker import attention, runner as runner_mod, sampler
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model import layers, llama
from jaxbatch.model.loader import load_model
from jaxbatch.model.rope import apply_rope, rope_tables
from jaxbatch.worker.step_inputs import MIN_DECODE_ROWS



# ---- the floor: dense, unpaged --------------------------------------------------------------

def _dense_attention(q, k_cache, v_cache, lengths, scale):
    """q [B, H, D]; caches [B, T, K, D]; attends to the first lengths[b] positions."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,btkd->bkgt", qg, k_cache) * scale
    mask = jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None]              # [B, T]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgt,btkd->bkgd", probs, v_cache).reshape(b, h, d)


def dense_decode(params, caches, tokens, positions, *, cfg, inv_freq, with_attention=True):
    """The floor. caches: tuple over layers of (k, v) [B, T, K, D], donated and returned."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    lengths = positions + 1
    x = params["embed"][tokens]
    new_caches = []
    rope = rope_tables(positions, inv_freq)
    for layer, (k_cache, v_cache) in zip(params["layers"], caches):
        h = llama.rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Fused or not, as the engine holds them (model/fused.py); per-layer: index unused.
        q, k, v = layers._projections(h, layer, "wqkv", (q_width, kv_width, kv_width), 0)
        q = q.reshape(b, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        if with_attention:
            k_cache = k_cache.at[rows, positions].set(k)
            v_cache = v_cache.at[rows, positions].set(v)
            out = _dense_attention(q, k_cache, v_cache, lengths, cfg.head_dim ** -0.5)
        else:
            out = q   # "matmuls only": same shapes, no attention work
        x = x + layers._dense(out.reshape(b, -1), layer["wo"])
        h = llama.rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        x = x + layers.mlp_block(layer, cfg, h, 0)   # per-layer weights: index unused
        new_caches.append((k_cache, v_cache))
    x = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return jnp.argmax(llama.compute_logits(params, x), axis=-1), tuple(new_caches)


def paged_greedy(params, pool, tokens, positions, slot_mapping, attn_meta, *, cfg, inv_freq,
                 backend):
    """The engine's paged forward (its attention backend), ending in argmax instead of the
    sampler."""
    attend = backend.decode_attend(attn_meta, cfg.attention_scale)   # a worker.attention backend
    hidden, pool = llama.forward_hidden(params, cfg, pool, tokens, positions, slot_mapping,
                                        attend, inv_freq)
    return jnp.argmax(llama.compute_logits(params, hidden), axis=-1), pool


# ---- timing -----------------------------------------------------------------------------------

class Piece:
    """A jitted function timed one call at a time; `state` (a donated cache) is threaded through."""

    def __init__(self, fn, state, args):
        self.fn, self.state, self.args, self.times = fn, state, args, []
        self.call()                                     # compile; not recorded

    def call(self):
        start = time.perf_counter()
        out, self.state = self.fn(self.state, *self.args)
        jax.block_until_ready((out, self.state))
        return time.perf_counter() - start

    def timed_call(self):
        self.times.append(self.call())


def steady_decode_engine(loaded, slots, ctx, rounds, seed, backend="auto"):
    """An engine with `slots` requests that will decode in lockstep for rounds + 2 steps, every
    length inside (ctx/2, ctx]. One chunk per prompt and a budget that holds them all put every
    prefill in the first step. No host/device overlap: a step is timed whole, with nothing of
    it still running on the device while the pieces are timed."""
    engine = LLMEngine(loaded=loaded, max_num_seqs=slots, max_model_len=ctx,
                       num_blocks=slots * (ctx // 16) + 1, prefill_chunk_size=ctx,
                       max_num_batched_tokens=slots * ctx + slots, warmup=False,
                       attention_backend=backend, async_scheduling=False)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=rounds + 3, ignore_eos=True)
    for i in range(slots):
        prompt = rng.integers(0, vocab, ctx - (rounds + 3)).tolist()
        engine.add_request(f"r{i}", prompt, params)
    return engine


def build_pieces(engine, plan, slots, ctx):
    """The engine's decode executable and the floor's pieces, on the inputs of `plan`."""
    runner, cfg = engine.runner, engine.model_config
    call = runner.layout.decode_call(plan)
    # --slots is a power of two >= MIN_DECODE_ROWS (main checks): the call has `slots` rows.
    assert call.key[1] == slots, f"--slots {slots}: use a power of two (the runner pads rows to one)"
    tokens, token_src, positions, slot_mapping, meta = call.args
    samp = runner._sampling_arrays(call.rows)
    params, inv_freq = runner.params, runner._inv_freq
    dev = tuple(jax.tree.map(jnp.asarray, (tokens, positions, slot_mapping, meta)))
    tokens, positions = dev[0], dev[1]
    # Own copies of the caches: the engine keeps stepping with its pool in between.
    pool = jax.tree.map(jnp.zeros_like, runner.pool)
    dtype = jax.tree.leaves(params)[0].dtype
    shape = (slots, ctx, cfg.num_kv_heads, cfg.head_dim)
    dense = tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))

    # The engine's two dispatches of a decode step: the model call, then the sampler.
    forward = jax.jit(functools.partial(runner_mod._decode_forward, cfg=cfg,
                                        backend=runner.attention, inv_freq=inv_freq),
                      donate_argnums=(1,))
    sample = jax.jit(sampler.sample)

    # The floor gets one array per layer weight (the engine's stacked [L, ...] arrays sliced
    # once, outside jit): slicing a stacked array inside an unrolled jit costs a copy per layer.
    floor_params = {**params, "layers": [{name: w[i] for name, w in params["layers"].items()}
                                          for i in range(cfg.num_layers)]}

    kept_tokens, token_src = runner.kept_tokens, jnp.asarray(token_src)

    def engine_exe(params, pool, *args):
        tokens, *inputs, samp_arrays = args
        logits, pool = forward(params, pool, kept_tokens, tokens, token_src, *inputs)
        return sample(logits, samp_arrays), pool
    paged = jax.jit(functools.partial(paged_greedy, cfg=cfg, inv_freq=inv_freq,
                                      backend=runner.attention), donate_argnums=(1,))
    floor = jax.jit(functools.partial(dense_decode, cfg=cfg, inv_freq=inv_freq),
                    donate_argnums=(1,))
    # Returns the tokens only: returning the (non-donated, untouched) caches would make XLA
    # copy them into fresh output buffers on every call.
    matmuls = jax.jit(lambda p, c, t, pos: dense_decode(p, c, t, pos, cfg=cfg, inv_freq=inv_freq,
                                                        with_attention=False)[0])
    return {
        "engine_executable": Piece(lambda st, *a: engine_exe(params, st, *a), pool, dev + (samp,)),
        "paged_forward_argmax": Piece(lambda st, *a: paged(params, st, *a),
                                      jax.tree.map(jnp.zeros_like, pool), dev),
        "dense_floor": Piece(lambda st, *a: floor(floor_params, st, *a), dense, (tokens, positions)),
        "dense_matmuls_only": Piece(lambda st, *a: (matmuls(floor_params, st, *a), st),
                                    ((None, None),) * cfg.num_layers, (tokens, positions)),
    }


def measure_context(loaded, slots, ctx, rounds, seed, backend="auto"):
    """Rounds interleave one engine.step() with one call of every piece, so a slow moment
    (other jobs on the machine) hits all of them alike; figures are medians over rounds and the
    ratio is the median of per-round ratios."""
    engine = steady_decode_engine(loaded, slots, ctx, rounds, seed, backend)
    engine_backend = engine.runner.backend
    # No overlap here (steady_decode_engine), so each step is read back within its step().
    with observe(engine, LastPlan()) as last:
        start = time.perf_counter()
        engine.step()                                  # every prefill; first tokens sampled
        prefill_s = time.perf_counter() - start
        engine.step()                                  # first decode step: compiles it
    plan = last.plan
    if plan.prefills or len(plan.decodes) != slots:
        raise RuntimeError(f"context {ctx}: expected {slots} decodes and no prefill")
    pieces = build_pieces(engine, plan, slots, ctx)

    step_times = []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        _, num_seqs, _, num_tokens = engine.step_log[-1]
        if num_seqs != slots or num_tokens != slots:
            raise RuntimeError(f"context {ctx}: left steady decode")
        for piece in pieces.values():
            piece.timed_call()
    del engine

    t = {name: np.asarray(p.times) for name, p in pieces.items()}
    step = np.asarray(step_times)
    med = lambda x: 1e3 * float(np.median(x))
    return {
        "slots": slots, "context": ctx, "attention_backend": engine_backend, "rounds": rounds,
        "prefill_seconds": prefill_s,
        "engine_step_ms": med(step),
        "floor_ms": med(t["dense_floor"]),
        "ratio_engine_over_floor": float(np.median(step / t["dense_floor"])),
        "breakdown_ms": {
            "matmuls": med(t["dense_matmuls_only"]),
            "attention": med(t["dense_floor"] - t["dense_matmuls_only"]),
            "paging": med(t["paged_forward_argmax"] - t["dense_floor"]),
            "sampling": med(t["engine_executable"] - t["paged_forward_argmax"]),
            "host": med(step - t["engine_executable"]),
        },
        "pieces_ms": {name: med(x) for name, x in t.items()},
        "pieces_min_ms": {**{name: 1e3 * float(x.min()) for name, x in t.items()},
                          "engine_step": 1e3 * float(step.min())},
    }


def markdown(results, target):
    rows = []
    for r in results:
        b = r["breakdown_ms"]
        verdict = "met" if r["ratio_engine_over_floor"] <= target else "missed"
        rows.append([r["slots"], r["context"], f"{r['engine_step_ms']:.1f}", f"{r['floor_ms']:.1f}",
                     f"{r['ratio_engine_over_floor']:.2f}", f"<= {target} ({verdict})"]
                    + [f"{b[k]:.1f}" for k in ("matmuls", "attention", "paging", "sampling",
                                               "host")])
    return table(["slots", "context", "engine step ms", "floor ms", "ratio", "target", "matmuls",
                  "attention", "paging", "sampling", "host"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="jaxbatch bench decode-floor",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512],
                    help="powers of two >= 64 (a page bucket is ctx / 16 pages)")
    ap.add_argument("--rounds", type=int, default=30,
                    help="timed rounds (one engine step + one call of each piece)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto",
                    help="the engine's attention backend (auto = xla on CPU)")
    ap.add_argument("--target", type=float, default=1.3, help="engine step / floor target")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    if args.slots & (args.slots - 1) or args.slots < MIN_DECODE_ROWS:
        ap.error(f"--slots must be a power of two of at least {MIN_DECODE_ROWS}: the runner "
                 f"pads decode rows to one")
    for ctx in args.contexts:
        if ctx & (ctx - 1) or ctx - (args.rounds + 3) <= ctx // 2:
            ap.error(f"context {ctx}: must be a power of two > 2 * (rounds + 3) so every "
                     f"length stays in one page bucket")

    loaded = load_model(dtype="float32")
    results = []
    for ctx in args.contexts:
        print(f"[decode_floor] slots={args.slots} context={ctx}: prefilling, then timing",
              flush=True)
        results.append(measure_context(loaded, args.slots, ctx, args.rounds, args.seed,
                                       args.attention_backend))
    out = {"machine": {"backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                       "jax": jax.__version__},
           "dtype": "float32", "model": loaded.source, "target_ratio": args.target,
           "results": results}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "decode_floor.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"[decode_floor] wrote {path}")
    print(markdown(results, args.target))
    return out


if __name__ == "__main__":
    main()
