"""What a forward takes besides the weights, as pytrees of named fields.

    KVPool         the paged KV cache: k, v [KVH, L * N, bs, Dh], and for an int8 pool their
                   float32 scales [KVH, L * N, bs] (`pallas_kernels/int8.py`); layer l's block
                   b is row l * N + b (`decoder.py`)
    TokenInputs    the call's tokens, positions and KV slots [T] int32 (slots of layer 0's
                   blocks; padding rows write into a null block's slot 0)
    LoRAInputs     a LoRA engine's adapter pool and each token's slot (0: no adapter)
"""
from __future__ import annotations

from typing import NamedTuple


class KVPool(NamedTuple):
    k: object
    v: object
    k_scales: object = None
    v_scales: object = None

    @property
    def scales(self):
        """(k_scales, v_scales) of an int8 pool, None for a float one."""
        return None if self.k_scales is None else (self.k_scales, self.v_scales)

    @property
    def dtype(self):
        """The pages' storage dtype."""
        return self.k.dtype


class TokenInputs(NamedTuple):
    tokens: object                                                            # [T] int32
    positions: object                                                         # [T] int32
    slot_mapping: object                                                      # [T] int32


class LoRAInputs(NamedTuple):
    slots: object                                                             # [T] int32
    a: dict                                   # {matrix: [L, S, r, in]}
    b: dict                                   # {matrix: [L, S, r, out]}
