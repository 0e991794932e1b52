"""Engine settings as a frozen record, validated on construction. No I/O."""
from __future__ import annotations

import dataclasses

POLICIES = ("fcfs", "priority", "shortest_prompt_first")
BATCHING_MODES = ("continuous", "static")


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    block_size: int = 16
    num_blocks: int = 1024            # including the null block 0
    max_model_len: int = 2048
    max_num_batched_tokens: int = 544  # decode tokens + prefill chunk tokens per step
    prefill_chunk_size: int = 512      # a prompt is computed in chunks of at most this many tokens
    scheduling_policy: str = "fcfs"
    batching: str = "continuous"
    # shortest_prompt_first: each step waited takes this many tokens off a request's sort key,
    # so a long prompt is eventually served whatever keeps arriving.
    aging_tokens_per_step: float = 4.0
    # Full blocks computed by full prefill chunks are kept, keyed by their prefix, and shared
    # by later prompts that start with the same tokens (jaxbatch/core/prefix_cache.py).
    enable_prefix_caching: bool = False
    # "chunk": hits end on the request's own prefill-chunk boundaries and only blocks of full
    # chunks are cached, so outputs are exactly those of a run without the cache. "block" (what
    # vLLM does): hits end on any block boundary and every full block a prefill computes is
    # cached, so short shared prefixes (a system prompt under a chunk) are shared too; what
    # follows a hit is then chunked from the hit, which may move the logits' last bits.
    prefix_cache_granularity: str = "chunk"

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"{field}={getattr(self, field)!r}: {why}")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            fail("block_size", "must be a power of two")
        if self.num_blocks < 2:
            fail("num_blocks", "must be >= 2 (block 0 is reserved)")
        if self.max_model_len < 2:
            fail("max_model_len", "must be >= 2")
        if self.prefill_chunk_size < 1 or self.prefill_chunk_size & (self.prefill_chunk_size - 1):
            fail("prefill_chunk_size", "must be a power of two")
        # A prefilling sequence holds a slot itself, so at most max_num_seqs - 1 others decode
        # beside it: this much budget guarantees every prompt its next chunk.
        if self.max_num_batched_tokens < self.max_num_seqs - 1 + self.prefill_chunk_size:
            fail("max_num_batched_tokens", f"must be >= max_num_seqs - 1 + prefill_chunk_size = "
                 f"{self.max_num_seqs - 1} + {self.prefill_chunk_size}, so a full decode batch "
                 "never starves a prompt of its next chunk")
        if self.num_blocks - 1 < self.max_pages_per_seq:
            fail("num_blocks", f"must hold one sequence of max_model_len={self.max_model_len} "
                 f"tokens: {self.max_pages_per_seq} blocks of {self.block_size} plus the null block")
        if self.scheduling_policy not in POLICIES:
            fail("scheduling_policy", f"choose one of {', '.join(POLICIES)}")
        if self.batching not in BATCHING_MODES:
            fail("batching", f"choose one of {', '.join(BATCHING_MODES)}")
        if self.prefix_cache_granularity not in ("chunk", "block"):
            fail("prefix_cache_granularity", "choose 'chunk' or 'block'")

    @property
    def prefix_hit_granularity(self) -> int:
        """Prefix hits end on a multiple of this many tokens. "chunk": the request's own chunk
        boundaries (whole blocks too), so what follows a hit is computed in exactly the chunks,
        and to exactly the numbers, of a run without the cache. "block": any block boundary."""
        if self.prefix_cache_granularity == "block":
            return self.block_size
        return max(self.prefill_chunk_size, self.block_size)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
