"""The wire format's shared pieces: the base models of request and response bodies, the field
policy (`check_fields`: every unknown field is refused by name, OpenAI's metadata accepted)
and the error body. protocol.py (chat, completions) and responses_protocol.py build on them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    """Response bodies, built by this server: a field they do not declare is a bug here, so it
    raises instead of being dropped."""
    model_config = ConfigDict(extra="forbid")


class _Request(BaseModel):
    """Request bodies: strict types; unknown keys are kept (`model_extra`) so `check_fields` can
    name them in its 400."""
    model_config = ConfigDict(extra="allow", strict=True)


# Legacy function calling: refused, naming what replaced it (tools and structured outputs
# are fields of the models below, read by structured.py).
REFUSED_FIELDS = {
    "functions": "'functions' is OpenAI's deprecated form of 'tools': send 'tools'",
    "function_call": "'function_call' is OpenAI's deprecated form of 'tool_choice': send "
                     "'tool_choice'"}

# OpenAI's metadata: accepted, and nothing for the engine to honour.
METADATA_FIELDS = {"user", "metadata", "store", "service_tier"}
# Bounds checked before any work (the engine's stop-string scan is per token and per string).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
# The seeds the engine honours: it keys each sequence's noise from a 32-bit seed.
SEED_RANGE = (0, 2 ** 32)


def check_fields(req: "_Request") -> tuple[str, str] | None:
    """(param, message) for the first field this server does not implement, or None."""
    for name in (req.model_extra or {}):
        if name in REFUSED_FIELDS:
            return name, REFUSED_FIELDS[name]
        if name not in METADATA_FIELDS:
            return name, f"'{name}' is not supported by this server"
    return None


def _drop_none(handler, obj, keys: tuple[str, ...]):
    data = handler(obj)
    for k in keys:
        if data.get(k) is None:
            data.pop(k, None)
    return data


# ---- errors --------------------------------------------------------------------------------
class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Model):
    error: ErrorInfo
