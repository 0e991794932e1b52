"""The model's forward as tests drive it directly: plain params (a checkpoint reader's or
`stack_layers`'), typed on the way in (`worker/weight_forms.py`), with the plain-jnp kernels
unless told otherwise."""
from __future__ import annotations

from jaxbatch.model import decoder
from jaxbatch.model.inputs import KVPool, TokenInputs
from jaxbatch.model.kernels import JNP_KERNELS
from jaxbatch.worker import weight_forms
from jaxbatch.worker.weight_forms import WeightForm

# XLA:CPU's forms without our kernels: per layer, transposed, q/k/v and gate/up fused.
CPU_FORM = WeightForm(per_layer=True, transposed=True, bits=True, fused=True)
# The same with our packed GEMM.
PACKED_FORM = WeightForm(per_layer=True, transposed=True, bits=True, fused=True,
                         packed=True)


def typed(params, form: WeightForm | None = None):
    """Plain or typed params in `form` (default: per layer, plain [in, out] matrices)."""
    return weight_forms.prepare(decoder.stack_layers(params, matrices_per_layer=True),
                                form or WeightForm(per_layer=True))


def forward_hidden(params, cfg, pool, tokens, positions, slots, attend, inv_freq,
                   kernels=JNP_KERNELS, lora=None, form=None):
    return decoder.forward_hidden(typed(params, form), KVPool(*pool),
                                  TokenInputs(tokens, positions, slots), cfg=cfg,
                                  kernels=kernels, attend=attend, inv_freq=inv_freq, lora=lora)


def compute_logits(params, hidden, cfg=None, form=None):
    return decoder.compute_logits(typed(params, form), hidden, cfg)
