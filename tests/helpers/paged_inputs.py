"""Random paged-attention inputs shared by the kernel tests: block tables over permuted pages
and a KV pool that is NaN wherever a test wrote nothing, so any masked key or value that
reaches arithmetic shows up as a non-finite output."""
from __future__ import annotations

import numpy as np


def nan_pool(num_kv_heads, num_blocks, block_size, head_dim):
    """(k, v) pages [KVH, N, bs, D], all NaN."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)


def fill_pages(rng, k, v, pages, length):
    """Random keys/values in the first `length` slots of `pages`; the rest stays NaN."""
    block_size = k.shape[2]
    pos = np.arange(int(length))
    blocks, offsets = np.asarray(pages)[pos // block_size], pos % block_size
    k[:, blocks, offsets] = rng.standard_normal((k.shape[0], len(pos), k.shape[3]))
    v[:, blocks, offsets] = rng.standard_normal((k.shape[0], len(pos), k.shape[3]))


def random_tables(rng, lengths, pages_per_seq, block_size, spare=3):
    """Block tables over randomly permuted pages 1..; unused entries point at block 0 or at a
    spare (NaN) page. Returns (tables [S, P] int32, number of blocks)."""
    needed = [-(-int(n) // block_size) for n in lengths]
    num_blocks = 1 + sum(needed) + spare
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), pages_per_seq), np.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = [free.pop() for _ in range(n)]
    spare_pages = np.asarray(free)
    unused = tables == 0
    poison = unused & (rng.random(tables.shape) < 0.5)
    tables[poison] = rng.choice(spare_pages, poison.sum())
    return tables, num_blocks


class SeededRng:
    """A numpy Generator that remembers its seed for failure messages."""

    def __init__(self, seed):
        self.seed = seed
        self._gen = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._gen, name)
