"""The KV cache manager: a sequence's KV blocks and the prefix cache, in one place.

The scheduler asks it two kinds of question. Allocation: `blocks` (the `BlockManager`: free
list, ref counts, block tables; block 0 is the null block) grows, shrinks and frees a
sequence's blocks. Prefix caching: `computed_blocks(seq)` is the run of cached blocks an
admitted sequence may start from, `start_from_cache` shares them, `cache_computed_blocks`
registers what a prefill chunk completed, and `cached_prefix_tokens` answers a router without
changing anything. `observe` attaches the prefix cache's observer (KV events). Keys are the sha256 chain of `prefix_cache.py`, rooted in the namespace
(model, dtype, block size, ...) and the request's `cache_salt`.

A hit never changes a request's output: it is cut to the request's own prefill-chunk
boundaries ("chunk" granularity) and stops short of the last token, so what follows is
computed in exactly the chunks a cold run computes. Pure Python, no JAX.
"""
from __future__ import annotations

from jaxbatch.core.block_manager import BlockManager
from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.prefix_cache import PrefixCacheObserver, extend_keys, root_key
from jaxbatch.core.request import Sequence


class KVCacheManager:
    def __init__(self, config: SchedulerConfig, cache_namespace: str = ""):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        self.cache_namespace = cache_namespace
        self.prefix_cache_queries = 0    # tokens of admitted sequences looked up in the cache
        self.prefix_cache_hits = 0       # of which found there

    @property
    def caching(self) -> bool:
        return self.blocks.prefix_index is not None

    def _root(self, cache_salt: str | None) -> bytes:
        return root_key(self.cache_namespace, cache_salt)

    def cacheable_prefix(self, num_tokens: int) -> int:
        """The longest hit allowed for a sequence of `num_tokens`: on its own chunk boundaries
        and short of its last token, whose logits are needed."""
        g = self.config.prefix_hit_granularity
        return (num_tokens - 1) // g * g

    def _cached_run(self, token_ids: list[int], cache_salt: str | None,
                    keys: list[bytes]) -> list[int]:
        """The cached blocks a sequence of these tokens may start from: the longest cached run,
        cut to the allowed prefix in whole chunks. `keys` memoises the block keys (extended)."""
        bs, g = self.config.block_size, self.config.prefix_hit_granularity
        limit = self.cacheable_prefix(len(token_ids))
        if limit == 0:
            return []
        root = self._root(cache_salt)
        extend_keys(keys, root, token_ids, bs, limit // bs)
        hits = self.blocks.cached_prefix(keys[:limit // bs], token_ids[:limit], root)
        return hits[:len(hits) // (g // bs) * (g // bs)]

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks this sequence may start from. Requests for prompt logprobs compute
        their whole prompt (a hit has no logits)."""
        if not self.caching or seq.params.prompt_logprobs is not None:
            return []
        return self._cached_run(seq.prompt_token_ids + seq.output_token_ids,
                                seq.params.cache_salt, seq.block_keys)

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Tokens a new request with this prompt would find in the cache now (a router's
        question: data-parallel replicas send a request where its prefix is). Changes nothing."""
        if not self.caching:
            return 0
        return len(self._cached_run(list(token_ids), cache_salt, [])) * self.config.block_size

    def start_from_cache(self, seq: Sequence, hits: list[int]) -> None:
        hit_tokens = len(hits) * self.config.block_size
        if hits:
            self.blocks.share_cached(seq.seq_id, hits)
            seq.num_computed_tokens = hit_tokens
        if self.caching and seq.params.prompt_logprobs is None:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)

    def cache_computed_blocks(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """The full blocks a prefill chunk of `num_tokens` from `start` completed. "chunk"
        granularity registers only full chunks: their blocks hold exactly what a cold run
        computes for this prefix (every earlier chunk of the run was full too, or came from
        the cache)."""
        if not self.caching or (num_tokens != self.config.prefill_chunk_size
                                and self.config.prefix_cache_granularity != "block"):
            return
        bs = self.config.block_size
        end = start + num_tokens
        tokens = seq.tokens(0, end // bs * bs)
        root = self._root(seq.params.cache_salt)
        keys = extend_keys(seq.block_keys, root, tokens, bs, end // bs)
        for i in range(start // bs, end // bs):
            self.blocks.register_cached(seq.seq_id, i, keys[i], keys[i - 1] if i else root,
                                        tokens[i * bs:(i + 1) * bs], (seq, i))

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def stats(self) -> dict:
        """The pool and the prefix cache, as LLMEngine.stats() reports them (num_gpu_blocks:
        vLLM's count of the pool, the null block included)."""
        return {"num_free_blocks": self.blocks.num_free_blocks,
                "num_total_blocks": self.blocks.num_total_blocks,
                "block_size": self.config.block_size, "num_gpu_blocks": self.config.num_blocks,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "prefix_cache_granularity": self.config.prefix_cache_granularity,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits}

    def observe(self, observer: PrefixCacheObserver) -> None:
        """`observer` is told of every block the prefix cache stores or evicts, and of resets
        (prefix_cache.py's seam; its `stored` origin is (sequence, block index))."""
        if not self.caching:
            raise ValueError("observing the prefix cache needs enable_prefix_caching=True")
        self.blocks.prefix_index.observer = observer
