"""What one thread or process asks of an engine it does not step itself, as small records:
the server's event loop of its engine thread (`entrypoints/async_llm.py`), a multi-process
engine's leader of its followers (`engine/multihost.py`, pickled). Plain data, no JAX."""
from __future__ import annotations

import dataclasses

from jaxbatch.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: object                   # text, token ids, or {"prompt_token_ids": [...]}
    params: SamplingParams | None
    priority: int
    arrival_time: float
    lora_request: object = None      # a jaxbatch.LoRARequest, or None: the base model

    def apply(self, engine) -> None:
        engine.add_request(self.request_id, self.prompt, self.params, priority=self.priority,
                           arrival_time=self.arrival_time, lora_request=self.lora_request)


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: object               # one id, or a list of them

    def apply(self, engine) -> None:
        engine.abort_request(self.request_id)


@dataclasses.dataclass(frozen=True)
class ResetPrefixCache:
    def apply(self, engine) -> None:
        engine.reset_prefix_cache()
