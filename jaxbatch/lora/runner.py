"""The runner of a LoRA engine: every model call also takes the adapter pool and each token
row's slot (0 = no adapter), so a batch mixes adapters freely with no new shapes. The pool is
an input like the params, never donated: loading an adapter rebinds `lora_pool.arrays`."""
from __future__ import annotations

import numpy as np

from jaxbatch.lora.pool import LoRAPool, target_shapes
from jaxbatch.model.decoder import num_layers_of
from jaxbatch.worker.runner import ModelRunner
from jaxbatch.worker.step_inputs import ModelCall


class LoRARunner(ModelRunner):
    def __init__(self, *args, max_loras: int, max_lora_rank: int, **kwargs):
        # Stored lowerings (lowered_store.py) are keyed without the LoRA inputs: none here.
        kwargs["lowered_dir"] = None
        super().__init__(*args, **kwargs)
        if self.tp is not None:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported")
        self.lora_pool = LoRAPool(target_shapes(self.params), num_layers_of(self.params),
                                  max_loras, max_lora_rank)
        self.seq_slot: dict[int, int] = {}       # the LoRA manager's: running seq_id -> slot

    def _model_args(self, key: tuple, call_args: tuple, call: ModelCall | None = None) -> tuple:
        return (super()._model_args(key, call_args, call)
                + (self.lora_pool.call_input(self._slots(key, call)),))

    def _slots(self, key: tuple, call: ModelCall | None) -> np.ndarray:
        """[rows] for a decode call, [tokens] for a prefill call; padding rows use slot 0."""
        slots = np.zeros(key[1], np.int32)
        if call is None:
            return slots
        if key[0] == "decode":
            for i, (seq_id, _) in enumerate(call.decode_rows):
                slots[i] = self.seq_slot.get(seq_id, 0)
            return slots
        for chunk, q0 in zip(call.chunks, call.q_starts):
            slots[q0:q0 + len(chunk.token_ids)] = self.seq_slot.get(chunk.seq_id, 0)
        return slots
