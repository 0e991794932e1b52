"""The keys of the runner's compiled functions, one per shape bucket: frozen records with named
fields, so the runner reads `key.kind`, `key.rows`, `key.lora` instead of positions in a tuple
and suffixes on a string.

  ModelCallKey   a forward pass: "decode" (rows, items: xla work items or pages), "prefill"
                 (tokens, pages), "mixed" (both, the decode part first); `lora`: the variant
                 that also takes the adapter pool (jaxbatch/lora/runner.py)
  SampleKey      what runs on a call's logits: "sample" / "verify_sample" (rows), or
                 "prompt_logprobs" (rows: the prefill call's tokens)

Each also reads as the tuple it used to be (`as_tuple()`: ("decode", rows, items),
("mixed", rows, items, tokens, pages), "_lora" on the kind; indexing, iteration, equality and
hash follow it): the form the executable observers (jaxbatch/benchmarks) and stored lowerings'
file names (lowered_store.py) use, and what `as_key` turns back into a record. Host only.
"""
from __future__ import annotations

import dataclasses

MODEL_CALLS = ("decode", "prefill", "mixed")
LORA_SUFFIX = "_lora"


class _ReadsAsTuple:
    def as_tuple(self) -> tuple:
        raise NotImplementedError

    def __getitem__(self, index):
        return self.as_tuple()[index]

    def __iter__(self):
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return len(self.as_tuple())

    def __eq__(self, other):
        if isinstance(other, _ReadsAsTuple):
            other = other.as_tuple()
        return self.as_tuple() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __lt__(self, other):         # sorted in the tuple form's order
        return self.as_tuple() < tuple(other)

    def __le__(self, other):
        return self.as_tuple() <= tuple(other)

    def __gt__(self, other):
        return self.as_tuple() > tuple(other)

    def __ge__(self, other):
        return self.as_tuple() >= tuple(other)

    def __str__(self) -> str:        # logs name a bucket as it always read
        return str(self.as_tuple())


@dataclasses.dataclass(frozen=True, eq=False)
class ModelCallKey(_ReadsAsTuple):
    kind: str                        # "decode" | "prefill" | "mixed"
    rows: int = 0                    # decode rows (decode, mixed)
    items: int = 0                   # decode attention size: work items or pages
    tokens: int = 0                  # prefill tokens (prefill, mixed)
    pages: int = 0                   # prefill pages
    lora: bool = False               # the variant taking the adapter pool and per-row slots

    @classmethod
    def decode(cls, rows: int, items: int) -> "ModelCallKey":
        return cls("decode", rows=rows, items=items)

    @classmethod
    def prefill(cls, tokens: int, pages: int) -> "ModelCallKey":
        return cls("prefill", tokens=tokens, pages=pages)

    @classmethod
    def mixed(cls, decode: "ModelCallKey", prefill: "ModelCallKey") -> "ModelCallKey":
        return cls("mixed", decode.rows, decode.items, prefill.tokens, prefill.pages)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The bucket's sizes in `StepLayout.placeholder_call`'s order."""
        if self.kind == "decode":
            return self.rows, self.items
        if self.kind == "prefill":
            return self.tokens, self.pages
        return self.rows, self.items, self.tokens, self.pages

    def with_lora(self, lora: bool = True) -> "ModelCallKey":
        return dataclasses.replace(self, lora=lora)

    def as_tuple(self) -> tuple:
        return (self.kind + (LORA_SUFFIX if self.lora else ""),) + self.sizes


@dataclasses.dataclass(frozen=True, eq=False)
class SampleKey(_ReadsAsTuple):
    kind: str                        # "sample" | "verify_sample" | "prompt_logprobs"
    rows: int

    def as_tuple(self) -> tuple:
        return self.kind, self.rows


def as_key(key) -> ModelCallKey | SampleKey:
    """A key record from a record or its tuple form (a bucket named on a command line)."""
    if isinstance(key, (ModelCallKey, SampleKey)):
        return key
    kind, *sizes = key
    lora = kind.endswith(LORA_SUFFIX)
    kind = kind.removesuffix(LORA_SUFFIX)
    if kind == "decode":
        return ModelCallKey.decode(*sizes).with_lora(lora)
    if kind == "prefill":
        return ModelCallKey.prefill(*sizes).with_lora(lora)
    if kind == "mixed":
        rows, items, tokens, pages = sizes
        return ModelCallKey("mixed", rows, items, tokens, pages, lora)
    (rows,) = sizes
    return SampleKey(kind, rows)
