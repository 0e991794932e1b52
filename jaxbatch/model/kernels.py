"""The operations a layer hands to a kernel, as one record: `Kernels`.

The model calls `k.matmul(x, w)` and `k.add_norm(x, h, w, eps, offset)` and never names a
kernel, a platform or a storage form. The record is chosen once per engine
(`jaxbatch/worker/kernels.py`, which logs why each entry is what it is); `JNP_KERNELS` is the
plain-jnp record, every other record's reference. Attention reaches a layer as its `attend`
function (the attention backend's, whose kernels the same choice fed), argmax reaches the
sampler the same way.

    matmul(x, w, epilogue=None)   x [T, in] @ w (`model/linear.py`: the weight applies itself)
                                  -> [T, out] in x's dtype; with `epilogue` (`linear.SILU_MUL`)
                                  the epilogue of the product
    add_norm(x, h, w, eps, offset) -> (x + h, rms_norm(x + h)): a residual add and the norm after it
    rows                          None, or the call's rows before its padding (int32 scalar,
                                  traced): matmuls may leave the rest out (`for_call`)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxbatch.model.norms import add_rms_norm


@dataclasses.dataclass(frozen=True)
class Kernels:
    add_norm: Callable = add_rms_norm
    rows: object = None
    # What chose each entry and why (worker/kernels.py): for stats() and the start-up log.
    reasons: tuple = ()

    def matmul(self, x, w, epilogue=None):
        if epilogue is None:
            return w.apply(x, self.rows)
        return w.apply_epilogue(x, epilogue, self.rows)

    def for_call(self, rows) -> "Kernels":
        """This record for one traced call whose rows past `rows` are padding."""
        return dataclasses.replace(self, rows=rows)

    # A record is a static argument of traced functions: compared by what it computes.
    def __hash__(self):
        return hash((self.add_norm, self.reasons))

    def __eq__(self, other):
        return (isinstance(other, Kernels) and self.add_norm == other.add_norm
                and self.reasons == other.reasons and self.rows is other.rows)


JNP_KERNELS = Kernels()
