"""The runner of a LoRA engine: a model call with any adapter row also takes the adapter pool
and each token row's slot (0 = no adapter), so a batch mixes adapters freely with no new
shapes; a call whose rows all use the base model runs the plain executable, exactly today's
path. So each model-call key has a LoRA twin (`ModelCallKey.lora`: the same function, given
the pool), both compiled at warm-up. The pool is an input like the params, never donated:
loading an adapter rebinds `lora_pool.arrays`. What to load and each sequence's slot come in
the plan (decided on the host by the LoRA manager, `StepPlan.adapter_loads` /
`adapter_slots`)."""
from __future__ import annotations

import numpy as np

from jaxbatch.lora.pool import LoRAPool, target_shapes
from jaxbatch.model.decoder import num_layers_of
from jaxbatch.worker.executable_keys import ModelCallKey, as_key
from jaxbatch.worker.runner import ModelRunner
from jaxbatch.worker.step_inputs import ModelCall


class LoRARunner(ModelRunner):
    def __init__(self, *args, max_loras: int, max_lora_rank: int, **kwargs):
        # EngineConfig refuses LoRA with tensor parallelism and keeps the lowered store off
        # (stored lowerings are keyed without the LoRA inputs): `uses_lowered_store`.
        super().__init__(*args, **kwargs)
        self.lora_pool = LoRAPool(target_shapes(self.params), num_layers_of(self.params),
                                  max_loras, max_lora_rank)
        self._adapter_slots: dict[int, int] = {}    # the dispatching plan's seq_id -> slot

    def apply_adapter_loads(self, plan) -> None:
        """Before the plan's model calls: the adapters it loads written into their slots (one
        in-place device write each, compiled when the pool was made), and its slots kept for
        laying out the calls' per-row slots."""
        for load in plan.adapter_loads:
            self.lora_pool.load(load.slot, load.weights)
        self._adapter_slots = plan.adapter_slots

    def bucket_shapes(self) -> list:
        keys = super().bucket_shapes()
        return keys + [k.with_lora() for k in keys if isinstance(k, ModelCallKey)]

    def example_args(self, key):
        key = as_key(key)
        if not isinstance(key, ModelCallKey):
            return super().example_args(key)
        args = super().example_args(key.with_lora(False))     # with the pool appended
        return args if key.lora else args[:-1]

    def _run(self, key, args):
        """Model calls arrive with the pool appended (`model_args`): kept, under the LoRA
        key, only if some row uses an adapter."""
        if not isinstance(key, ModelCallKey):
            return super()._run(key, args)
        if np.any(args[-1].slots):
            return super()._run(key.with_lora(), args)
        return super()._run(key, args[:-1])

    def model_args(self, key, call_args: tuple, call: ModelCall | None = None) -> tuple:
        return (super().model_args(key, call_args, call)
                + (self.lora_pool.call_input(self._slots(as_key(key), call)),))

    def _slots(self, key: ModelCallKey, call: ModelCall | None) -> np.ndarray:
        """[rows] for a decode call, [tokens] for a prefill call, [rows + tokens] for a mixed
        one; padding rows use slot 0."""
        if key.kind == "mixed":
            if call is None:
                return np.zeros(key.rows + key.tokens, np.int32)
            return np.concatenate([self._slots(part.key, part) for part in call.parts])
        slots = np.zeros(key.rows if key.kind == "decode" else key.tokens, np.int32)
        if call is None:
            return slots
        if key.kind == "decode":
            for i, (seq_id, _) in enumerate(call.decode_rows):
                slots[i] = self._adapter_slots.get(seq_id, 0)
            return slots
        for chunk, q0 in zip(call.chunks, call.q_starts):
            slots[q0:q0 + len(chunk.token_ids)] = self._adapter_slots.get(chunk.seq_id, 0)
        return slots
