"""What the scheduler hands the runner, and what comes back. Plain data, no JAX."""
from __future__ import annotations

import dataclasses

import numpy as np

# A sampled token the host has not read yet (host/device overlap): the scheduler plans the next
# step with it in place, and the runner takes the real token from the device (by slot).
PENDING_TOKEN = -1


@dataclasses.dataclass
class PrefillChunk:
    """Tokens [start, start + len(token_ids)) of one sequence, computed in one call."""
    seq_id: int
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool                     # the chunk ends at the sequence's last token
    prompt_logprobs: int | None      # top-k wanted for prompt positions in this chunk
    slot: int = -1                   # the sequence's slot: where its sampled token is kept
    pool: bool = False               # an embedding request's: pooled, never sampled


@dataclasses.dataclass
class DecodeEntry:
    """One token (at `position`) of the sequence in `slot`; with speculation, also the proposed
    tokens that follow it (positions position + 1 ...), each verified in a row of its own.
    `token_id` is PENDING_TOKEN when the previous step sampled it and it is still on device."""
    seq_id: int
    slot: int
    token_id: int
    position: int
    block_table: list[int]
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Sampled drafts (draft_sampling="sampled"): [len(draft_token_ids), V] f32, the draft's
    # distribution q each proposed token was drawn from; None for one-hot (greedy, n-gram).
    draft_probs: np.ndarray | None = None


@dataclasses.dataclass
class SamplingRow:
    """Per-sequence sampling inputs, in the order the runner samples."""
    seq_id: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    position: int                    # position of the token being sampled: keys the PRNG
    num_prompt_tokens: int
    history: list[int]               # prompt + output tokens so far (for penalties)
    banned_token_ids: list[int]      # EOS / stop ids while min_tokens is not reached
    logprobs: int | None
    logit_bias: dict[int, float] | None = None   # token id -> bias added before sampling


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterLoad:
    """A plan's order to the runner: write these host weights into device slot `slot` (slot 0
    is no adapter, never loaded)."""
    slot: int
    weights: object                  # jaxbatch.lora.adapter.LoRAWeights (host numpy)


@dataclasses.dataclass
class StepPlan:
    step: int
    prefills: list[PrefillChunk]
    decodes: list[DecodeEntry]
    sampling: dict[int, SamplingRow]  # seq_id -> row, for every sequence that samples
    # seq_id -> the sampling row of each proposed token's verification row
    draft_sampling: dict[int, list[SamplingRow]] = dataclasses.field(default_factory=dict)
    dispatched: bool = False          # Scheduler.on_dispatched has run for it
    # LoRA engines (jaxbatch/lora/): adapters to write into the device pool before this step's
    # model calls (decided at admission, applied by the runner), and the adapter slot of each
    # of the plan's sequences that uses one (absent: the base model).
    adapter_loads: list["AdapterLoad"] = dataclasses.field(default_factory=list)
    adapter_slots: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + sum(len(d.draft_token_ids) for d in self.decodes)
                + sum(len(c.token_ids) for c in self.prefills))

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


@dataclasses.dataclass
class StepResult:
    sampled: dict[int, SampledToken]                              # seq_id -> token
    # seq_id -> [(prompt position p, {token: logprob} for the token at p given tokens < p)]
    prompt_logprobs: dict[int, list[tuple[int, dict[int, float]]]]
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # seq_id -> the token sampled at each verification row (after each proposed token)
    draft_sampled: dict[int, list[SampledToken]] = dataclasses.field(default_factory=dict)
    # seq_id -> its pooled chunk's vector [d] float32 (embedding requests, worker/pooling.py)
    pooled: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


def pad_block_table(table: list[int], num_pages: int) -> np.ndarray:
    """Unused entries point at the null block 0."""
    out = np.zeros(num_pages, np.int32)
    n = min(len(table), num_pages)
    out[:n] = table[:n]
    return out
