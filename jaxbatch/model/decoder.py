"""The decoder every family shares, as pure functions of a params pytree.

Params layout (a plain dict; weights stored [in, out] so `x @ w` reads naturally):
    embed      [V, d]
    layers     one dict over layers: vectors stacked on a leading axis L (attn_norm [L, d],
               mlp_norm [L, d], bq/bk/bv [L, ...] when qkv_bias, bo [L, d] when o_bias,
               q_norm/k_norm [L, Dh], post_attn_norm/post_mlp_norm [L, d]), and matrices
               (wq [d, H*Dh], wk/wv [d, K*Dh], wo [H*Dh, d], w_gate/w_up [d, F], w_down [F, d],
               w_router [d, E]) either stacked too ([L, in, out]) or kept as a tuple of L
               arrays; expert stacks (we_gate/we_up [L, E, d, F], we_down [L, E, F, d]) are
               always stacked. Key names: `model/weights.py`. Before a forward runs, each
               matrix becomes a typed weight (`model/linear.py`) in the form the engine's
               kernels read (`worker/weight_forms.py`: on CPU wq/wk/wv and w_gate/w_up fused
               per layer into wqkv and w_gate_up).
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
(`matrices_per_layer_default` picks by platform; the engine's `weight_layout` overrides):
  stacked [L, in, out]  (GPU) the scan slices layer l out of the stack, which XLA:GPU feeds to
                        its GEMM in place. XLA:CPU would copy every slice before its dot
                        (every weight, every step).
  tuple of L arrays     (CPU) each matmul is a `lax.switch` over the L weights, whose chosen
                        branch reads its weight where it lies, stored transposed [out, in] for
                        XLA:CPU's dots (`linear.OutIn`, `linear.PerLayer`). Unrolling the
                        layers instead (no switch) made decode steps faster still but compiled
                        each step for every layer: a cold start took twice as long. On a GPU
                        a switch would also sync the host.

The KV pool (`inputs.KVPool`) is one (k, v) pair of pages, each [num_kv_heads, L * num_blocks,
block_size, head_dim], plus (k_scales, v_scales) [num_kv_heads, L * num_blocks, block_size] when
the pages are int8 (`pallas_kernels/int8.py`): layer l's block b is row l * num_blocks + b. Folding the
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

from jaxbatch.model.config import NO_WINDOW, ModelConfig
from jaxbatch.model.inputs import KVPool, LoRAInputs, TokenInputs
from jaxbatch.model.kernels import Kernels
from jaxbatch.model.layers import AttendFn, Layer, attention_block, mlp_block, moe_block, unsharded
from jaxbatch.model.linear import Dense, OutIn, PerLayer, is_linear
from jaxbatch.model.lora_delta import NO_LORA, LayerLoRA
from jaxbatch.model.norms import rms_norm
from jaxbatch.model.rope import rope_tables

# A window no sequence reaches: what a full layer of a windowed model attends with.
UNBOUNDED_WINDOW = 1 << 30


def matrices_per_layer_default(platform: str | None = None) -> bool:
    """Whether layer matrices are kept apart (a tuple of L arrays) rather than stacked
    [L, in, out]: on CPU, where the layer scan would copy every stacked slice before its dot
    (XLA:CPU's dot fusions cannot read a dynamic slice in place)."""
    return (platform or jax.default_backend()) == "cpu"


def stack_layers(params: dict, matrices_per_layer: bool | None = None) -> dict:
    """A checkpoint reader's per-layer dicts -> the layers dict above. `matrices_per_layer`
    keeps the 2-D matrices as a tuple of L arrays; None: the platform's default (see the
    module doc). Vectors and expert stacks are always stacked. Numpy or jax arrays; int8
    matrices ({"int8", "scale"}) stacked part by part. A layers dict is kept as it is."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    if matrices_per_layer is None:
        matrices_per_layer = matrices_per_layer_default()
    out = {}
    for name in layers[0]:
        per_layer = [layer[name] for layer in layers]
        first = per_layer[0]
        is_matrix = (first["int8"] if isinstance(first, dict) else first).ndim == 2
        out[name] = tuple(per_layer) if is_matrix and matrices_per_layer else _stack(per_layer)
    return {**params, "layers": out}


def _stack(arrays: list):
    """[L x (array or int8 {"int8", "scale"})] -> one stack (int8: its values and its scales)."""
    stack = np.stack if isinstance(jax.tree.leaves(arrays)[0], np.ndarray) else jnp.stack
    if isinstance(arrays[0], dict):
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


def forward_hidden(params, pool: KVPool, inputs: TokenInputs, *, cfg: ModelConfig,
                   kernels: Kernels, attend: AttendFn, inv_freq, per_shard: Callable = unsharded,
                   lora: LoRAInputs | None = None):
    """inputs: tokens, positions, slot_mapping [T] int32; inv_freq [R/2] (every layer) or
    [L, R/2] (`rope.inverse_frequencies`) -> (final-normed hidden [T, d], new pool).

    `params`: the layers dict (`stack_layers`) with typed matrices (`model/linear.py`);
    `kernels`: the engine's kernels for this call (`Kernels.for_call`).

    `per_shard(fn)` runs the KV write and attention, `fn(q, k, v, pool)`, once per
    tensor-parallel shard of the heads (`jaxbatch/parallel/sharding.py`: a `jax.shard_map`,
    since kernels are opaque to automatic sharding); on one device it is the identity.

    `lora`: None, or a LoRA engine's adapter pool and per-token slots (jaxbatch/lora/pool.py);
    scanned beside the weights, each matrix's delta added after its matmul."""
    layers = params["layers"]
    num_layers = layers["attn_norm"].shape[0]
    blocks_per_layer = pool.k.shape[1] // num_layers
    # Stacked arrays are scanned over (sliced per layer); per-layer tuples are closed over
    # whole and picked by index inside each matmul.
    per_layer = {k: v for k, v in layers.items() if isinstance(v, PerLayer)}
    stacked = {k: v for k, v in layers.items() if not isinstance(v, PerLayer)}
    x = params["embed"][inputs.tokens]                                        # [T, d]
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    ffn = moe_block if cfg.num_experts else mlp_block
    k = kernels

    lora_xs, one_hot = {}, None
    if lora is not None:
        one_hot = jax.nn.one_hot(lora.slots, next(iter(lora.a.values())).shape[1],
                                 dtype=jnp.float32)                            # [T, S]
        lora_xs = {name: (lora.a[name], lora.b[name]) for name in lora.a}

    # Each residual add meets the norm after it in one `add_norm`: the scan carries the last
    # layer's MLP output beside the residual stream (zeros into the first layer), and the
    # final norm adds the last one.
    def one_layer(carry, xs):
        x, h, pool = carry
        weights, data, index, lora_layer = xs
        layer = Layer({**weights, **per_layer}, index,
                      LayerLoRA(lora_layer, one_hot) if lora_layer else NO_LORA)
        x, normed = k.add_norm(x, h, layer["attn_norm"], eps, offset)
        h, pool = attention_block(k, layer, cfg, normed, layer_rope(data), inputs.slot_mapping,
                                  pool, index * blocks_per_layer, attend, data.get("window"),
                                  per_shard)
        if cfg.sandwich_norm:
            h = rms_norm(h, layer["post_attn_norm"], eps, offset)
        x, normed = k.add_norm(x, h, layer["mlp_norm"], eps, offset)
        h = ffn(k, layer, cfg, normed)
        if cfg.sandwich_norm:
            h = rms_norm(h, layer["post_mlp_norm"], eps, offset)
        return (x, h, pool), None

    per_layer_data, rope = _per_layer_data(cfg, inv_freq, inputs.positions)

    def layer_rope(data):
        """This layer's (cos, sin) [T, R]."""
        if "rope_row" not in data:
            return rope
        return tuple(table[data["rope_row"]] for table in rope)

    xs = (stacked, per_layer_data, jnp.arange(num_layers, dtype=jnp.int32), lora_xs)
    (x, h, pool), _ = jax.lax.scan(one_layer, (x, jnp.zeros_like(x), pool), xs)
    return k.add_norm(x, h, params["final_norm"], eps, offset)[1], pool


def padding_start(slot_mapping):
    """[T] int32 -> int32 scalar: the call's rows up to its last real one. Padding rows write
    into a null block's slot 0, where no real token writes, and the runner's layouts put them
    last (a mixed call's padding decode rows, before its prefill tokens, count as real)."""
    rows = jnp.arange(1, slot_mapping.shape[0] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(slot_mapping != 0, rows, 0))


def compute_logits(params, hidden, cfg: ModelConfig | None = None, rows=None):
    """hidden [N, d] -> float32 logits [N, V], from the typed `lm_head` [d, V], or from the
    tied `embed` [V, d] (its d axis contracted in place, never a transposed copy; a kernel's
    copy of it, where the weights' form keeps one, as `tied_head`); soft-capped where the
    model says so (Gemma 2; `cfg` None: no cap). `rows`: the call's rows before its padding,
    or None."""
    head = params.get("lm_head", params.get("tied_head"))
    if head is None:
        head = OutIn(params["embed"])                                         # [V, d]
    elif not is_linear(head):
        head = Dense(head)                                                    # [d, V]
    logits = head.apply(hidden, rows, out_dtype=jnp.float32)                  # [N, V]
    cap = None if cfg is None else cfg.final_soft_cap
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits
