"""A model call's step inputs, as pytrees of named fields (the runner lays them out of
`step_inputs.ModelCall.args`; the KV pool and LoRA inputs are `model/inputs.py`'s).

    DecodeInputs    rows B: each row's token (or `token_src` >= 0: the token its slot sampled
                    last step, still on device in `kept_tokens` [S]), position, KV slot, and
                    the attention backend's metadata
    PrefillInputs   tokens T packed chunk after chunk, and `sample_index` [C]: the row of
                    each chunk's last token, whose logits are sampled
"""
from __future__ import annotations

from typing import NamedTuple


class DecodeInputs(NamedTuple):
    kept_tokens: object                                                       # [S] int32
    tokens: object                                                            # [B] int32
    token_src: object                                                         # [B] int32
    positions: object                                                         # [B] int32
    slot_mapping: object                                                      # [B] int32
    attention: tuple                          # the backend's decode metadata

    @classmethod
    def of(cls, kept_tokens, args: tuple) -> "DecodeInputs":
        """From a decode call's args (`step_inputs.ModelCall.args`)."""
        return cls(kept_tokens, *args)


class PrefillInputs(NamedTuple):
    tokens: object                                                            # [T] int32
    positions: object                                                         # [T] int32
    slot_mapping: object                                                      # [T] int32
    attention: tuple                          # the backend's prefill metadata
    sample_index: object                                                      # [C] int32

    @classmethod
    def of(cls, args: tuple) -> "PrefillInputs":
        return cls(*args)


DECODE_ARGS = len(DecodeInputs._fields) - 1       # a decode call's args (kept_tokens is not one)
