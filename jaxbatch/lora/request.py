"""LoRARequest: which adapter a request uses (vLLM's names). Plain data, no JAX."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id`: a positive integer naming the adapter within one engine (as vLLM, 0 is
    "no adapter"); `lora_path`: a PEFT directory (adapter_config.json +
    adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def check(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} must be a non-empty string")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be a positive "
                             "integer")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} must be a path")


def lora_cache_salt(cache_salt: str | None, request: "LoRARequest | None") -> str | None:
    """The prefix-cache salt of a request using `request`'s adapter: KV computed under one
    adapter is never shared with the base model or another adapter."""
    if request is None:
        return cache_salt
    return f"{cache_salt or ''}\x1flora:{request.lora_int_id}:{request.lora_path}"


def user_cache_salt(cache_salt: str | None, request: "LoRARequest | None") -> str | None:
    """The salt the user gave, from `lora_cache_salt`'s result (None if none was given)."""
    if request is None or cache_salt is None:
        return cache_salt
    suffix = f"\x1flora:{request.lora_int_id}:{request.lora_path}"
    return cache_salt.removesuffix(suffix) or None


def per_request(lora_request, n: int) -> list:
    """`generate(..., lora_request=)`: one LoRARequest (or None) for all, or a list of n."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"lora_request: {len(lora_request)} given for {n} prompts")
        return list(lora_request)
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, not {type(lora_request).__name__}")
    return [lora_request] * n
