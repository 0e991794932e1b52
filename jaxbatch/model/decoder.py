"""The decoder every family shares, as pure functions of a params pytree.

Params layout (a plain dict; weights stored [in, out] so `x @ w` reads naturally):
    embed      [V, d]
    layers     one dict over layers: vectors stacked on a leading axis L (attn_norm [L, d],
               mlp_norm [L, d], bq/bk/bv [L, ...] when qkv_bias, bo [L, d] when o_bias,
               q_norm/k_norm [L, Dh], post_attn_norm/post_mlp_norm [L, d]), and matrices
               (wq [d, H*Dh], wk/wv [d, K*Dh], wo [H*Dh, d], w_gate/w_up [d, F], w_down [F, d],
               w_router [d, E]) either stacked too ([L, in, out]) or kept as a tuple of L
               arrays; expert stacks (we_gate/we_up [L, E, d, F], we_down [L, E, F, d]) are
               always stacked. Key names: `model/weights.py`. On CPU wq/wk/wv and
               w_gate/w_up are fused, per layer, into wqkv and w_gate_up (`fused.py`).
    final_norm [d]
    lm_head    [d, V]   absent when embeddings are tied
Checkpoint readers produce a list of per-layer dicts; `stack_layers` turns it into this form.
With int8 weights (`model/quantize.py`) each layer matrix is a dict {"int8", "scale"}, stacked
or per layer in the same way.

The forward is one layer's computation iterated with `lax.scan`: compiled once, not once per
layer, which is what makes a 30-layer step compile in about a second instead of ten. What
differs between a family's layers (the attention window, which RoPE table) is scanned
per-layer data beside the weights, never a Python branch per layer; what differs between
families (q/k norms, sandwich norms, experts, soft caps) is static config, so a Llama compiles
exactly what it did before families existed. Two ways for the scan to reach a layer's matrices
(`precision.matrices_per_layer_default` picks by platform; JAXBATCH_WEIGHT_LAYOUT overrides):
  stacked [L, in, out]  (GPU) the scan slices layer l out of the stack, which XLA:GPU feeds to
                        its GEMM in place. XLA:CPU would copy every slice before its dot
                        (every weight, every step).
  tuple of L arrays     (CPU) each matmul is a `lax.switch` over the L weights, whose chosen
                        branch reads its weight where it lies, stored transposed [out, in] for
                        XLA:CPU's dots (`precision.to_storage`). Unrolling the layers instead
                        (no switch) made decode steps faster still but compiled each step for
                        30 layers: a cold start took twice as long (docs/BENCHMARKS.md,
                        2026-12-03). On a GPU a switch would also sync the host.

The KV pool is one (k_pages, v_pages) pair, each [num_kv_heads, L * num_blocks, block_size,
head_dim], plus (k_scales, v_scales) [num_kv_heads, L * num_blocks, block_size] when the pages
are int8 (`pallas_kernels/int8.py`): layer l's block b is row l * num_blocks + b. Folding the
layer into the block axis lets the scan carry the whole pool and update it in place (a scatter
into the carry), while every attention kernel still sees the plain one-layer layout
[KVH, blocks, block_size, Dh]: a layer only shifts its block ids by l * num_blocks. Block 0 of
each layer is that layer's null block.
Attention is injected as `attend(q, k_pages, v_pages, block_offset, ...)` (`layers.AttendFn`),
so the same forward runs a decode step, a prefill chunk, the plain-jnp reference or a Pallas
kernel.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model import fused, precision, storage
from jaxbatch.model.config import NO_WINDOW, ModelConfig
from jaxbatch.model.layers import (AttendFn, _dense, add_rms_norm, attention_block, mlp_block,
                                   moe_block, rms_norm, unsharded)
from jaxbatch.model.quantize import is_quantized
from jaxbatch.model.rope import rope_tables

# A window no sequence reaches: what a full layer of a windowed model attends with.
UNBOUNDED_WINDOW = 1 << 30


def stack_layers(params: dict, matrices_per_layer: bool | None = None) -> dict:
    """Per-layer dicts -> the layers dict above. `matrices_per_layer` keeps the 2-D matrices
    as a tuple of L arrays; None: the platform's default (see the module doc). Vectors and
    expert stacks are always stacked. Numpy or jax arrays. A layers dict is kept as it is,
    except that `matrices_per_layer=False` stacks its per-layer matrices (in any
    `storage.prepare` form, fused ones split back into their parts, a packed head unpacked)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        if matrices_per_layer is False:
            return {**storage.unpack(params), "layers": {name: _stack([w if is_quantized(w) else
                                                        precision.as_float(w) for w in value])
                                         if isinstance(value, tuple) else value
                                         for name, value in fused.unfuse(layers).items()}}
        return params
    if matrices_per_layer is None:
        matrices_per_layer = precision.matrices_per_layer_default()
    out = {}
    for name in layers[0]:
        per_layer = [layer[name] for layer in layers]
        is_matrix = (per_layer[0]["int8"] if is_quantized(per_layer[0]) else per_layer[0]).ndim == 2
        out[name] = tuple(per_layer) if is_matrix and matrices_per_layer else _stack(per_layer)
    return {**params, "layers": out}


def _stack(arrays: list):
    """[L x (array or int8 {"int8", "scale"})] -> one stack (int8: its values and its scales)."""
    stack = np.stack if isinstance(jax.tree.leaves(arrays)[0], np.ndarray) else jnp.stack
    if is_quantized(arrays[0]):
        return {part: stack([w[part] for w in arrays]) for part in arrays[0]}
    return stack(arrays)


def num_layers_of(params: dict) -> int:
    layers = params["layers"]
    if isinstance(layers, list):
        return len(layers)
    return layers["attn_norm"].shape[0]


def _per_layer_data(cfg: ModelConfig, inv_freq, positions) -> tuple[dict, tuple]:
    """What the scan hands each layer besides its weights, and what every layer shares.
    RoPE's (cos, sin), computed here once for the call's positions (`rope.rope_tables`): one
    [T, R] pair when every layer has the same frequencies; else one [U, T, R] pair, a table per
    distinct frequency row (Gemma 3: a local and a global base), and each layer's row scanned
    as "rope_row" [L]. For models with windows, each layer's window [L] (full layers: a window
    no sequence reaches)."""
    data = {}
    if jnp.ndim(inv_freq) == 1:
        tables = rope_tables(positions, jnp.asarray(inv_freq), cfg.rope_attention_factor)
    else:                       # a constant of the call (the runner's), never traced
        rows, row_of_layer = np.unique(np.asarray(inv_freq), axis=0, return_inverse=True)
        tables = rope_tables(positions, jnp.asarray(rows), cfg.rope_attention_factor)
        data["rope_row"] = jnp.asarray(row_of_layer.reshape(-1), jnp.int32)
    if cfg.layer_windows is not None:
        data["window"] = jnp.asarray([UNBOUNDED_WINDOW if w == NO_WINDOW else w
                                      for w in cfg.layer_windows], jnp.int32)
    return data, tables


def forward_hidden(params, cfg: ModelConfig, kv_pool, tokens, positions, slot_mapping,
                   attend: AttendFn, inv_freq, per_shard: Callable = unsharded, lora=None,
                   rows=None):
    """tokens, positions, slot_mapping: [T] int32 (slots of layer 0's blocks);
    kv_pool = (k_pages, v_pages) [KVH, L * N, bs, Dh], plus (k_scales, v_scales) [KVH, L * N, bs]
    for an int8 pool; inv_freq [R/2] (every layer) or [L, R/2] (`rope.inverse_frequencies`)
    -> (final-normed hidden [T, d], new pool of the same structure).

    `per_shard(fn)` runs the KV write and attention, `fn(q, k, v, *pool)`, once per
    tensor-parallel shard of the heads (`jaxbatch/parallel/sharding.py`: a `jax.shard_map`,
    since kernels are opaque to automatic sharding); on one device it is the identity.

    `lora`: None, or the LoRA adapter pool of a LoRA engine (jaxbatch/lora/pool.py):
    {"slots": [T] int32 (0 = no adapter), "A": {matrix: [L, S, r, in]}, "B": {matrix:
    [L, S, r, out]}}; scanned beside the weights, each matrix's slice reaches `_matmul`.

    `rows`: None, or an int32 scalar, the tokens before the call's padding (`padding_start`):
    the packed GEMMs leave the rest out (`precision.with_rows`), and their rows of the result
    are not to be read."""
    params = stack_layers(params)
    num_layers = num_layers_of(params)
    blocks_per_layer = kv_pool[0].shape[1] // num_layers
    # Stacked arrays are scanned over (sliced per layer); per-layer tuples are closed over
    # whole and picked by index inside each matmul.
    per_layer = {k: v for k, v in params["layers"].items() if isinstance(v, tuple)}
    if rows is not None:
        per_layer = precision.with_rows(per_layer, rows)
    stacked = {k: v for k, v in params["layers"].items() if not isinstance(v, tuple)}
    x = params["embed"][tokens]                                               # [T, d]
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    ffn = moe_block if cfg.num_experts else mlp_block

    lora_xs, one_hot = {}, None
    if lora is not None:
        one_hot = jax.nn.one_hot(lora["slots"], lora["A"][next(iter(lora["A"]))].shape[1],
                                 dtype=jnp.float32)                            # [T, S]
        lora_xs = {name: (lora["A"][name], lora["B"][name]) for name in lora["A"]}

    # Each residual add meets the norm after it in one `add_rms_norm`: the scan carries the
    # last layer's MLP output beside the residual stream (zeros into the first layer), and
    # the final norm adds the last one.
    kernel = _norms_on_cpu_kernel(per_layer)

    def one_layer(carry, xs):
        x, h, pool = carry
        layer, data, index, lora_layer = xs
        layer = {**layer, **per_layer,
                 **{f"lora_{name}": (a, b, one_hot) for name, (a, b) in lora_layer.items()}}
        x, normed = add_rms_norm(x, h, layer["attn_norm"], eps, offset, kernel)
        h, pool = attention_block(layer, cfg, normed, layer_rope(data), slot_mapping, pool,
                                  index, index * blocks_per_layer, attend, data.get("window"),
                                  per_shard)
        if cfg.sandwich_norm:
            h = rms_norm(h, layer["post_attn_norm"], eps, offset)
        x, normed = add_rms_norm(x, h, layer["mlp_norm"], eps, offset, kernel)
        h = ffn(layer, cfg, normed, index)
        if cfg.sandwich_norm:
            h = rms_norm(h, layer["post_mlp_norm"], eps, offset)
        return (x, h, pool), None

    per_layer_data, rope = _per_layer_data(cfg, inv_freq, positions)

    def layer_rope(data):
        """This layer's (cos, sin) [T, R]."""
        if "rope_row" not in data:
            return rope
        return tuple(table[data["rope_row"]] for table in rope)

    xs = (stacked, per_layer_data,
          jnp.arange(num_layers, dtype=jnp.int32), lora_xs)
    (x, h, pool), _ = jax.lax.scan(one_layer, (x, jnp.zeros_like(x), tuple(kv_pool)), xs)
    return add_rms_norm(x, h, params["final_norm"], eps, offset, kernel)[1], pool


def _norms_on_cpu_kernel(per_layer: dict) -> bool:
    """Whether the norms may take the CPU kernel (`layers.add_rms_norm`): where the matrices
    take our packed GEMM (a CPU, one device), as the step's other kernels do."""
    return any(precision.is_packed(w[0]) for w in per_layer.values())


def padding_start(slot_mapping):
    """[T] int32 -> int32 scalar: the call's rows up to its last real one. Padding rows write
    into a null block's slot 0, where no real token writes, and the runner's layouts put them
    last (a mixed call's padding decode rows, before its prefill tokens, count as real)."""
    rows = jnp.arange(1, slot_mapping.shape[0] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(slot_mapping != 0, rows, 0))


def compute_logits(params, hidden, cfg: ModelConfig | None = None, rows=None):
    """hidden [N, d] -> float32 logits [N, V], soft-capped where the model says so (Gemma 2;
    `cfg` None: no cap). `rows`: as in `forward_hidden`."""
    logits = precision.logits(params, hidden, rows)  # float32, never a transposed copy
    cap = None if cfg is None else cfg.final_soft_cap
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits
