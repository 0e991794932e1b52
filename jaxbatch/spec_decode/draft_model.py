"""Draft-model proposer for speculative decoding: a smaller checkpoint with the target's
vocabulary, run by the same engine code (an `LLMEngine` over its own paged KV pool).

Each step, every speculating sequence becomes one request of k tokens on the draft engine, and
they are stepped together. The draft engine's own prefix cache keeps each sequence's KV between
steps in whole chunks, so a step recomputes at most about a chunk plus k tokens per sequence.

draft_sampling="greedy" (default): proposals are the draft's argmax (one-hot q); the target
accepts one while it equals its own sample (jaxbatch/spec_decode/speculative.py), which is lossless for any
target sampling settings. "sampled": a request with temperature > 0 gets a draft request with
its temperature, top-k, top-p and min-p and a seed derived from its own (`draft_seed`: the
draft's noise must be independent of the target's), so its proposals are samples of the draft's
distribution q; the draft runner keeps each sampled row's q (`keep_sampling_probs`) and the
proposal carries them (`SampledDraft`) to the target's rejection step.
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from jaxbatch.model.loader import LoadedModel, load_model
from jaxbatch.core.plan import SamplingRow
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.spec_decode.speculative import SampledDraft, draft_seed

DRAFT_PREFILL_CHUNK = 32   # small: a draft recomputes up to a chunk of each sequence per step
logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, model: str | LoadedModel, engine_class, *, target_vocab_size: int,
                 max_num_seqs: int, max_model_len: int, dtype: str, warmup: bool,
                 compilation_cache: bool, warmup_runs: bool = True, attention_backend: str = "auto",
                 draft_sampling: str = "greedy", unified_step: bool = True):
        """`engine_class`: the draft is an engine itself (the engine passes its own class, so
        this room never imports the engine's)."""
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype)
        if loaded.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config model: vocabulary of {loaded.config.vocab_size} "
                             f"tokens, the target's has {target_vocab_size}: the draft must share "
                             "the target's tokenizer")
        # Past the draft's own context it proposes nothing (sequences longer than it can hold).
        self.max_len = min(max_model_len, loaded.config.max_position_embeddings)
        self.engine = engine_class(
            loaded=loaded, max_num_seqs=max_num_seqs, max_model_len=self.max_len,
            prefill_chunk_size=DRAFT_PREFILL_CHUNK, warmup=False, warmup_runs=warmup_runs,
            compilation_cache=compilation_cache, attention_backend=attention_backend,
            unified_step=unified_step, enable_prefix_caching=True,
            async_scheduling=False)   # proposals wanted now
        self.sampled = draft_sampling == "sampled"
        if self.sampled:
            self.engine.runner.keep_sampling_probs()   # before warm-up compiles "sample"
        if warmup:
            self.engine.warmup()
        self._ids = itertools.count()

    def _params(self, row: SamplingRow | None, k: int) -> SamplingParams:
        if not self.sampled or row is None or row.temperature == 0:
            return SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        return SamplingParams(temperature=row.temperature, top_k=row.top_k, top_p=row.top_p,
                              min_p=row.min_p, seed=draft_seed(row.seed), max_tokens=k,
                              ignore_eos=True)

    def propose_batch(self, requests: dict[int, tuple[list[int], int]],
                      rows: dict[int, SamplingRow] | None = None) -> dict[int, list[int]]:
        """`rows`: each sequence's sampling row (its settings and seed), for sampled drafts.
        A draft failure costs its proposals, never the target's step."""
        seq_of = {}     # draft request id -> (target seq_id, draft seq_id, prompt length, sampled)
        proposals = {}
        try:
            for seq_id, (token_ids, k) in requests.items():
                k = min(k, self.max_len - 1 - len(token_ids))
                if k <= 0:
                    continue
                rid = f"draft-{next(self._ids)}"
                params = self._params((rows or {}).get(seq_id), k)
                self.engine.add_request(rid, token_ids, params)
                # The draft engine's sequence id keys the q its runner keeps.
                draft_seq_id = self.engine.sequence_ids(rid)[0]
                seq_of[rid] = (seq_id, draft_seq_id, len(token_ids), params.temperature > 0)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        seq_id, draft_seq_id, start, sampled = seq_of[out.request_id]
                        tokens = list(out.outputs[0].token_ids)
                        if sampled:
                            kept = self.engine.runner.kept_probs
                            tokens = SampledDraft(tokens, np.stack(
                                [kept.pop((draft_seq_id, start + i)) for i in range(len(tokens))]))
                        proposals[seq_id] = tokens
        except Exception:   # noqa: BLE001 - log it, abort the draft requests, propose nothing
            logger.exception("the draft model failed; no proposals this step")
            self.engine.abort_request(list(seq_of))
            while self.engine.has_unfinished_requests():
                self.engine.step()
            return {}
        finally:
            if self.sampled:
                self.engine.runner.kept_probs.clear()
        return proposals
