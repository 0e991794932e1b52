"""The protocol every engine implements: the plain `LLMEngine`, data-parallel replicas
(`engine/data_parallel.py`) and the multi-process engine (`engine/multihost.py`).

Callers (`LLM`, the server's engine thread, benchmarks) use only these members, so they never
need to ask which kind of engine they hold. The members a plain engine has no use for
(`is_leader`, `follow`, `release`, `shutdown`) are part of the protocol anyway, with trivial
bodies in `EngineBase`, rather than probed for with `hasattr`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from jaxbatch.outputs import RequestOutput
from jaxbatch.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: object
    model_config: object          # jaxbatch.model.config.ModelConfig
    config: object                # jaxbatch.core.config.SchedulerConfig (resolved sizes)
    is_leader: bool               # False on a process that follows another's steps

    # `lora_request`: a jaxbatch.LoRARequest, or None for the base model (every engine takes
    # it; one built without enable_lora refuses a LoRARequest with a ValueError).
    def validate_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                         priority: int = 0, lora_request=None
                         ) -> tuple[str | None, list[int], SamplingParams]: ...
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request=None) -> None: ...
    def abort_request(self, request_id) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def has_pending_outputs(self) -> bool: ...
    def get_num_unfinished_requests(self) -> int: ...
    def cached_prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int: ...
    def reset_prefix_cache(self) -> bool: ...
    def warmup(self) -> float: ...
    def stats(self) -> dict: ...
    def follow(self) -> bool: ...
    def release(self) -> None: ...
    def shutdown(self) -> None: ...
    def prepare_for_serving(self) -> None: ...
    # LoRA adapters (vLLM's names): read and check one into the host cache (ValueError with
    # the reader's message), forget one no unfinished request uses (False if unknown), the ids
    # of those the engine holds.
    def add_lora(self, lora_request) -> bool: ...
    def remove_lora(self, lora_name: str) -> bool: ...
    def list_loras(self) -> set[int]: ...


class EngineBase:
    """Defaults for the members only some engines need."""

    is_leader = True

    def follow(self) -> bool:
        raise RuntimeError("this engine leads its own steps; only a follower process of a "
                           "multi-process engine follows")

    def release(self) -> None:
        """Ends a batch (a multi-process engine lets its followers return)."""

    def shutdown(self) -> None:
        """Ends the engine's helpers (a multi-process engine stops its followers)."""

    def add_lora(self, lora_request) -> bool:
        raise ValueError("LoRA adapters need an engine built with enable_lora=True")

    def remove_lora(self, lora_name: str) -> bool:
        raise ValueError("LoRA adapters need an engine built with enable_lora=True")

    def list_loras(self) -> set[int]:
        return set()

    def prepare_for_serving(self) -> None:
        """Work a server wants done before the first request, off the engine thread."""
