"""The runner of a LoRA engine: a model call with any adapter row also takes the adapter pool
and each token row's slot (0 = no adapter), so a batch mixes adapters freely with no new
shapes; a call whose rows all use the base model runs the plain executable, exactly today's
path. So each model-call key has a "_lora" twin ("decode_lora", rows, size), both compiled
at warm-up. The pool is an input like the params, never donated: loading an adapter rebinds
`lora_pool.arrays`. What to load and each sequence's slot come in the plan (decided on the
host by the LoRA manager, `StepPlan.adapter_loads` / `adapter_slots`)."""
from __future__ import annotations

import numpy as np

from jaxbatch.lora.pool import LoRAPool, target_shapes
from jaxbatch.model.decoder import num_layers_of
from jaxbatch.worker.runner import MODEL_CALLS, ModelRunner
from jaxbatch.worker.step_inputs import ModelCall


LORA = "_lora"


class LoRARunner(ModelRunner):
    def __init__(self, *args, max_loras: int, max_lora_rank: int, **kwargs):
        # Stored lowerings (lowered_store.py) are keyed without the LoRA inputs: none here.
        kwargs["lowered_dir"] = None
        super().__init__(*args, **kwargs)
        if self.tp is not None:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported")
        self.lora_pool = LoRAPool(target_shapes(self.params), num_layers_of(self.params),
                                  max_loras, max_lora_rank)
        self._adapter_slots: dict[int, int] = {}    # the dispatching plan's seq_id -> slot
        functions = self.executables.functions
        for kind in MODEL_CALLS:     # the same function, called with the pool appended
            functions[kind + LORA] = functions[kind]

    def apply_adapter_loads(self, plan) -> None:
        """Before the plan's model calls: the adapters it loads written into their slots (one
        in-place device write each, compiled when the pool was made), and its slots kept for
        laying out the calls' per-row slots."""
        for load in plan.adapter_loads:
            self.lora_pool.load(load.slot, load.weights)
        self._adapter_slots = plan.adapter_slots

    def bucket_shapes(self) -> list[tuple]:
        keys = super().bucket_shapes()
        return keys + [(k[0] + LORA,) + k[1:] for k in keys if k[0] in MODEL_CALLS]

    def is_model_call(self, key: tuple) -> bool:
        return key[0].removesuffix(LORA) in MODEL_CALLS

    def example_args(self, key: tuple):
        if key[0].endswith(LORA):
            return super().example_args((key[0][:-len(LORA)],) + key[1:])
        args = super().example_args(key)
        return args[:-1] if key[0] in MODEL_CALLS else args

    def _run(self, key: tuple, args):
        """Model calls arrive with the pool appended (`_model_args`): kept, under the "_lora"
        key, only if some row uses an adapter."""
        if key[0] not in MODEL_CALLS:
            return super()._run(key, args)
        if np.any(args[-1].slots):
            return super()._run((key[0] + LORA,) + key[1:], args)
        return super()._run(key, args[:-1])

    def _model_args(self, key: tuple, call_args: tuple, call: ModelCall | None = None) -> tuple:
        return (super()._model_args(key, call_args, call)
                + (self.lora_pool.call_input(self._slots(key, call)),))

    def _slots(self, key: tuple, call: ModelCall | None) -> np.ndarray:
        """[rows] for a decode call, [tokens] for a prefill call, [rows + tokens] for a mixed
        one; padding rows use slot 0."""
        if key[0] == "mixed":
            if call is None:
                return np.zeros(key[1] + key[3], np.int32)
            return np.concatenate([self._slots(part.key, part) for part in call.parts])
        slots = np.zeros(key[1], np.int32)
        if call is None:
            return slots
        if key[0] == "decode":
            for i, (seq_id, _) in enumerate(call.decode_rows):
                slots[i] = self._adapter_slots.get(seq_id, 0)
            return slots
        for chunk, q0 in zip(call.chunks, call.q_starts):
            slots[q0:q0 + len(chunk.token_ids)] = self._adapter_slots.get(chunk.seq_id, 0)
        return slots
