"""PoolingParams (vLLM's name) and the pooler an engine runs with. Pure Python.

An embedding request runs its prompt through the model once (prefill only, no token sampled,
its KV freed at once) and hands back the final-normed hidden states pooled into one vector.
`PoolerConfig` is the engine's: how hidden states become a vector (`pooling_type`), whether it
is scaled to unit length, which Matryoshka truncations the model was trained for. A request's
`PoolingParams` may ask for one of those truncations (`dimensions`)."""
from __future__ import annotations

import dataclasses

POOLING_TYPES = ("last", "mean", "cls")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: "last" (the prompt's last token: decoder embedding models such as
    Qwen3-Embedding), "mean" (over every prompt token) or "cls" (the first token's).
    `matryoshka_dimensions`: the truncations `dimensions` may ask for; () none, None any
    (the checkpoint says `is_matryoshka` without a list)."""
    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = ()

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r}; choose one of "
                             f"{', '.join(POOLING_TYPES)}")

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless `dimensions` (None: the model's whole vector) is a truncation
        this model was trained for."""
        if dimensions is None:
            return
        if not self.matryoshka_dimensions and self.matryoshka_dimensions is not None:
            raise ValueError("dimensions: this model does not support Matryoshka truncation "
                             "(its config.json has no matryoshka_dimensions)")
        allowed = self.matryoshka_dimensions
        if not 1 <= dimensions <= self.hidden_size or (allowed and dimensions not in allowed):
            choices = (f"one of {list(allowed)}" if allowed
                       else f"between 1 and {self.hidden_size}")
            raise ValueError(f"dimensions={dimensions} must be {choices}")


@dataclasses.dataclass
class PoolingParams:
    """`dimensions`: keep the first `dimensions` values of the embedding (Matryoshka), then
    normalize (when the model normalizes). None: the whole vector."""
    dimensions: int | None = None

    def _validate(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"PoolingParams.dimensions={d!r} must be a positive integer")
