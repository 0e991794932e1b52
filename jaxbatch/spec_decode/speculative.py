"""Speculative decoding, host side: settings, proposers and the acceptance counters. Pure Python.

A decoding sequence that speculates sends its last token plus k proposed tokens as k + 1 rows of
the step's decode call (rows of one sequence see each other's KV: each layer writes the rows'
keys and values before any row attends). Row i samples position num_tokens + i exactly as plain
decoding would: the same (seed, position) key, penalties over the history with the proposals
before it, min_tokens bans counted from its own output length. The scheduler accepts proposals
while each equals the token sampled at the row before it and keeps the first mismatching
sample, so the tokens are those of decoding without speculation (lossless for any sampling
settings). A proposer only guesses; it never changes what is sampled.

`propose_batch({seq_id: (token_ids, k)}, {seq_id: sampling row}) -> {seq_id: proposal}` is the
one seam: n-gram prompt lookup lives here; a draft model (jaxbatch/spec_decode/draft_model.py: a second
engine over its own paged KV pool) is built by the engine, which keeps this module and the
scheduler free of JAX.

`draft_sampling` (draft_model only): "greedy" (default) proposes the draft's argmax, a one-hot
q, for which the rule above is the standard rejection sampler and the tokens stay identical to
decoding without speculation. "sampled" draws each proposal of a request with temperature > 0
from the draft's own distribution q (the request's temperature, top-k, top-p, min-p; a seed
derived from the sequence's) and returns q (`SampledDraft`); the verification row then accepts
with probability min(1, p/q) and otherwise samples the residual (jaxbatch/worker/rejection_sampler.py).
That preserves the target distribution, not the tokens: more proposals are accepted when the
draft is good but not the target's argmax. Temperature-0 requests keep greedy proposals.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

METHODS = ("ngram", "draft_model")
DRAFT_SAMPLING = ("greedy", "sampled")
# The draft samples under seed ^ DRAFT_SEED_MASK: never the target's own seed, so the draft's
# noise is independent of the noise of the rows that verify it.
DRAFT_SEED_MASK = 0x9E3779B9


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Speculate only while at most this many sequences decode: a CPU decode step costs in
    # proportion to its rows, so extra rows pay off only when a step is mostly fixed cost
    # (measured in docs/BENCHMARKS.md, "Speculative decoding").
    max_batch_size: int = 4
    model: str | None = None          # draft_model: a checkpoint with the target's vocabulary
    draft_sampling: str = "greedy"    # draft_model: "greedy" | "sampled" (see the module doc)

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"speculative_config {field}={getattr(self, field)!r}: {why}")
        if self.method not in METHODS:
            fail("method", f"choose one of {', '.join(METHODS)}")
        if self.method == "draft_model" and not self.model:
            fail("model", "draft_model needs a model path")
        if self.draft_sampling not in DRAFT_SAMPLING:
            fail("draft_sampling", f"choose one of {', '.join(DRAFT_SAMPLING)}")
        if self.draft_sampling == "sampled" and self.method != "draft_model":
            fail("draft_sampling", "only a draft_model has a distribution to sample from")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            fail("num_speculative_tokens", "must be an integer in [1, 16]")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            fail("prompt_lookup_min", "must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            fail("prompt_lookup_max", "must be an integer >= prompt_lookup_min")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            fail("max_batch_size", "must be an integer >= 1")

    @classmethod
    def from_dict(cls, config: dict | None) -> "SpeculativeConfig | None":
        if config is None:
            return None
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or None, not {type(config).__name__}")
        unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        return cls(**config)


class NgramProposer:
    """Prompt lookup: the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) are searched for earlier in its own prompt and output; the tokens that
    followed the latest earlier occurrence are proposed."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_batch(self, requests: dict[int, tuple[list[int], int]],
                      rows=None) -> dict[int, list[int]]:
        return {sid: self.propose(tokens, k) for sid, (tokens, k) in requests.items()}

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # windows[i] = tokens[i:i + n] for every start that leaves a token after it.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return tokens[follow:follow + k].tolist()
        return []


class SampledDraft(list):
    """A proposal drawn from the draft's distribution: the token ids (a list, like every
    proposal) and `probs`, [len, V] f32, the q each was drawn from."""

    def __init__(self, token_ids, probs: np.ndarray):
        super().__init__(token_ids)
        self.probs = probs


def draft_probs(proposal, n: int) -> np.ndarray | None:
    """q of a proposal's first n tokens (after the scheduler trimmed it), None if one-hot."""
    probs = getattr(proposal, "probs", None)
    return None if probs is None else probs[:n]


def draft_seed(seed: int) -> int:
    return (seed ^ DRAFT_SEED_MASK) & 0xFFFFFFFF


def make_proposer(config: SpeculativeConfig):
    if config.method != "ngram":
        raise ValueError(f"the engine builds the {config.method} proposer")
    return NgramProposer(config)


@dataclasses.dataclass
class SpecCounters:
    """vLLM's spec_decode counters: drafts (sequences that speculated in a step), draft tokens
    proposed, accepted tokens, accepted tokens by position in the draft."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating sequence gains per step: accepted proposals plus the sample."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# An engine's stats() without speculation: the same keys as SpeculativePlanner.stats().
NO_SPECULATION_STATS = {"speculative_method": None, "spec_num_drafts": 0,
                        "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0,
                        "spec_accepted_per_position": [], "spec_mean_accepted_length": 0.0}
