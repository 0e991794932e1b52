"""Draft-model proposer for speculative decoding: a smaller checkpoint with the target's
vocabulary, run by the same engine code (an `LLMEngine` over its own paged KV pool).

Each step, every speculating sequence becomes one greedy request of k tokens on the draft
engine, and they are stepped together. The draft engine's own prefix cache keeps each
sequence's KV between steps in whole chunks, so a step recomputes at most about a chunk plus k
tokens per sequence. Proposals are greedy (one-hot): the target accepts one while it equals its
own sample (jaxbatch/speculative.py), which is lossless for any target sampling settings.
"""
from __future__ import annotations

import itertools
import logging

from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.sampling_params import SamplingParams

DRAFT_PREFILL_CHUNK = 32   # small: a draft recomputes up to a chunk of each sequence per step
logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, model: str | LoadedModel, *, target_vocab_size: int, max_num_seqs: int,
                 max_model_len: int, dtype: str, warmup: bool, compilation_cache: bool,
                 attention_backend: str = "auto"):
        from jaxbatch.engine import LLMEngine      # the draft is an engine itself
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype)
        if loaded.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config model: vocabulary of {loaded.config.vocab_size} "
                             f"tokens, the target's has {target_vocab_size}: the draft must share "
                             "the target's tokenizer")
        # Past the draft's own context it proposes nothing (sequences longer than it can hold).
        self.max_len = min(max_model_len, loaded.config.max_position_embeddings)
        self.engine = LLMEngine(
            loaded=loaded, max_num_seqs=max_num_seqs, max_model_len=self.max_len,
            prefill_chunk_size=DRAFT_PREFILL_CHUNK, warmup=warmup,
            compilation_cache=compilation_cache, attention_backend=attention_backend,
            enable_prefix_caching=True, async_scheduling=False)   # proposals wanted now
        self._ids = itertools.count()

    def propose_batch(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """A draft failure costs its proposals, never the target's step."""
        seq_of = {}
        proposals = {}
        try:
            for seq_id, (token_ids, k) in requests.items():
                k = min(k, self.max_len - 1 - len(token_ids))
                if k <= 0:
                    continue
                rid = f"draft-{next(self._ids)}"
                self.engine.add_request(rid, token_ids, SamplingParams(
                    temperature=0, max_tokens=k, ignore_eos=True))
                seq_of[rid] = seq_id
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        proposals[seq_of[out.request_id]] = list(out.outputs[0].token_ids)
        except Exception:   # noqa: BLE001 - log it, abort the draft requests, propose nothing
            logger.exception("the draft model failed; no proposals this step")
            self.engine.abort_request(list(seq_of))
            while self.engine.has_unfinished_requests():
                self.engine.step()
            return {}
        return proposals
