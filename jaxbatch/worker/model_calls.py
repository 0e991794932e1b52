"""The model calls the runner compiles, as pure functions of (params, pool, inputs, lora):
each lays its step inputs out for the forward (`model/decoder.py`), runs it with the engine's
kernels (`kernels.for_call`: the call's rows before its padding) and attention backend, and
returns the logits it samples from and the new pool.

    decode_forward   rows B -> (logits [B, V], pool)
    prefill_forward  tokens T in chunks C -> (logits [C, V], hidden [T, d], pool)
    mixed_forward    a decode call's rows and a prefill call's tokens as one pass over the
                     weights -> (decode logits, prefill logits, prefill hidden, pool)
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxbatch.model.decoder import compute_logits, forward_hidden, padding_start, stack_layers
from jaxbatch.model.inputs import KVPool, TokenInputs
from jaxbatch.model.kernels import JNP_KERNELS
from jaxbatch.model.layers import unsharded
from jaxbatch.worker import attention, sampler, weight_forms
from jaxbatch.worker.inputs import DecodeInputs, PrefillInputs


def _decode_tokens(inputs: DecodeInputs):
    """Each row's token: rows whose `token_src` is a slot decode the token that slot sampled
    last step, still on device (host/device overlap), the others `tokens`."""
    kept, src = inputs.kept_tokens, inputs.token_src
    return jnp.where(src >= 0, kept[jnp.maximum(src, 0)], inputs.tokens)           # [B]


def decode_forward(params, pool: KVPool, inputs: DecodeInputs, lora=None, *, cfg, backend,
                    kernels, inv_freq, per_shard=unsharded):
    """-> (logits [B, V], pool)."""
    # attention_scale / compute_logits(.., cfg): families scale scores and cap logits.
    attend = backend.decode_attend(inputs.attention, cfg.attention_scale)
    rows = padding_start(inputs.slot_mapping)
    tokens = TokenInputs(_decode_tokens(inputs), inputs.positions, inputs.slot_mapping)
    hidden, pool = forward_hidden(params, pool, tokens, cfg=cfg, kernels=kernels.for_call(rows),
                                  attend=attend, inv_freq=inv_freq, per_shard=per_shard,
                                  lora=lora)                                    # [B, d]
    return compute_logits(params, hidden, cfg, rows), pool                      # [B, V]


def prefill_forward(params, pool: KVPool, inputs: PrefillInputs, lora=None, *, cfg, backend,
                     kernels, inv_freq, per_shard=unsharded):
    """-> (logits of the sampled rows [S, V], hidden [T, d], pool). `lora` (every forward):
    the LoRA pool and per-token slots, only in a LoRA engine's calls (jaxbatch/lora/runner.py
    appends it); without it the traced function is unchanged."""
    attend = backend.prefill_attend(inputs.attention, cfg.attention_scale)
    tokens = TokenInputs(inputs.tokens, inputs.positions, inputs.slot_mapping)
    k = kernels.for_call(padding_start(inputs.slot_mapping))
    hidden, pool = forward_hidden(params, pool, tokens, cfg=cfg, kernels=k, attend=attend,
                                  inv_freq=inv_freq, per_shard=per_shard, lora=lora)  # [T, d]
    last = hidden[inputs.sample_index]                                          # [S, d]
    return compute_logits(params, last, cfg), hidden, pool                      # [S, V], [T, d]


def mixed_forward(params, pool: KVPool, inputs: tuple[DecodeInputs, PrefillInputs], lora=None,
                   *, cfg, backend, kernels, inv_freq, per_shard=unsharded):
    """A decode call's inputs (rows B) then a prefill call's (tokens T) as one forward pass
    over [B + T] tokens; `lora` slots cover both, in that order.
    -> (decode logits [B, V], prefill logits [S, V], prefill hidden [T, d], pool)."""
    decode, prefill = inputs
    rows = decode.tokens.shape[0]
    slot_mapping = jnp.concatenate([decode.slot_mapping, prefill.slot_mapping])
    tokens = TokenInputs(jnp.concatenate([_decode_tokens(decode), prefill.tokens]),
                         jnp.concatenate([decode.positions, prefill.positions]), slot_mapping)
    attend = attention.mixed_attend(rows, backend.decode_attend(decode.attention, cfg.attention_scale),
                                    backend.prefill_attend(prefill.attention, cfg.attention_scale))
    k = kernels.for_call(padding_start(slot_mapping))
    hidden, pool = forward_hidden(params, pool, tokens, cfg=cfg, kernels=k, attend=attend,
                                  inv_freq=inv_freq, per_shard=per_shard, lora=lora)  # [B + T, d]
    prefill_hidden = hidden[rows:]
    # One LM-head matmul for both parts' sampled rows: the head is the largest single weight,
    # and the point of a mixed call is to read each weight once per step.
    logits = compute_logits(params, jnp.concatenate([hidden[:rows],
                                                     prefill_hidden[prefill.sample_index]]), cfg)
    return logits[:rows], logits[rows:], prefill_hidden, pool


def prompt_logprobs_step(params, hidden, targets, *, cfg=None):
    logits = compute_logits(params, hidden, cfg)                               # [T, V]
    return sampler.prompt_logprobs(logits, targets)


def reference_forward(params, cfg, pool, tokens, positions, slot_mapping, attend, inv_freq,
                      quantization=None):
    """The forward over plain params (a loader's, or `stack_layers`') with the plain-jnp
    kernels and matrices as they are: for tools that drive the model directly (accuracy
    measurements). -> (final hidden [T, d], pool)."""
    typed = reference_params(params, quantization)
    return forward_hidden(typed, KVPool(*pool), TokenInputs(tokens, positions, slot_mapping),
                          cfg=cfg, kernels=JNP_KERNELS, attend=attend, inv_freq=inv_freq)


def reference_params(params, quantization=None):
    """Plain params as `reference_forward` and `compute_logits` read them (idempotent);
    `quantization="w8a8"`: int8 matrices against int8 activations (the jnp reference, which
    the CPU kernel equals bit for bit)."""
    form = weight_forms.WeightForm(per_layer=True,
                                   w8a8_kernel="jnp" if quantization == "w8a8" else None)
    return weight_forms.prepare(stack_layers(params), form)
