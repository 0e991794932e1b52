"""A step's sampled outputs, read back from the device, as the host's records."""
from __future__ import annotations

import numpy as np

from jaxbatch.core.plan import PrefillChunk, SampledToken


def sampled_token(row, tokens, logprob, top_ids, top_lp, k) -> SampledToken:
    top = None
    if k:
        top = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lp[row, :k])}
    return SampledToken(int(tokens[row]), float(logprob[row]), top)


def prompt_logprobs_entries(chunk: PrefillChunk, q0: int, next_token: int, out) -> list[tuple[int, dict[int, float]]]:
    """Logits at packed row q0 + i (chunk position i) score the token at absolute position
    start + i + 1."""
    target, top_ids, top_lp = (np.asarray(x) for x in out)
    k = chunk.prompt_logprobs
    following = list(chunk.token_ids[1:]) + [next_token]
    entries = []
    for i, token in enumerate(following):
        if token < 0:
            continue
        row = q0 + i
        d = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lp[row, :k])}
        d[int(token)] = float(target[row])
        entries.append((chunk.start + i + 1, d))
    return entries
