"""Iteration-level scheduler. Pure Python, no JAX.

Every step: (1) admit waiting sequences into free slots (continuous: any step; static: only when
the whole previous group has finished), (2) give every decoding sequence its one token,
(3) spend what is left of the token budget on prefill chunks. Blocks are allocated as sequences
grow; when they run out the policy's worst running sequence is preempted (its blocks freed,
its tokens recomputed later). `update` appends the sampled tokens and applies token-level stops;
stop strings need the tokenizer and are the engine's job (it calls `finish`).

Blocks and the prefix cache belong to the KV cache manager (`kv_cache_manager.py`): an admitted
sequence starts from the computed blocks it finds there; the blocks each dispatched prefill
chunk completed are handed back to it for later prompts. Speculative decoding reaches the
scheduler through the planner it is handed (`spec_decode/planner.py`): `accept` and then
`propose_next` in `update`, `attach` (the proposals made after the last update) in the plan.
"""
from __future__ import annotations

import bisect
import time

from jaxbatch.core.config import SchedulerConfig
from jaxbatch.core.kv_cache_manager import KVCacheManager
from jaxbatch.core.plan import (PENDING_TOKEN, DecodeEntry, PrefillChunk, SampledToken, SamplingRow,
                           StepPlan, StepResult)
from jaxbatch.core.policies import policy_key
from jaxbatch.core.request import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: tuple[int, ...] = (),
                 cache_namespace: str = "", speculation=None):
        """`cache_namespace` names what the KV depends on besides the tokens (model, dtype,
        block size): it roots every prefix-cache key. `speculation`: the speculative planner
        (jaxbatch/spec_decode/planner.py: `accept` and `propose_next` in update, `attach` in
        the plan),
        or None."""
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv_cache = KVCacheManager(config, cache_namespace)
        self.blocks = self.kv_cache.blocks      # allocation: grow, shrink, free, block tables
        self.speculation = speculation
        # LoRA engines' admission seam (jaxbatch/lora/manager.py): begin_admission, can_admit,
        # admitted, released, finished; None otherwise.
        self.admission = None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(config.max_num_seqs))
        self.step_count = 0
        self.num_preemptions = 0

    # ---- bookkeeping ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _key(self, seq: Sequence):
        c = self.config
        return policy_key(c.scheduling_policy, seq, self.step_count, c.aging_tokens_per_step)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        if self.admission is not None:
            self.admission.released(seq)
        if seq.slot is not None:
            bisect.insort(self.free_slots, seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason=None) -> None:
        while seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
            seq.output_token_ids.pop()     # finished before its token was read: not its token
        self._release(seq)
        if self.admission is not None:
            self.admission.finished(seq)
        seq.status = status
        seq.stop_reason = stop_reason
        seq.finished_time = time.monotonic()

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style: drop the KV, keep the tokens; the sequence queues again. One whose
        token on device is certain to end it loses nothing (it finishes when the token is
        read, never recomputed), so that is not counted as a preemption."""
        if not self._ends_with_pending_token(seq):
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.append(seq)

    # ---- planning ------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.config.batching == "static" and self.running:
            return
        # Blocks the running sequences still need for what they hold plus one new token: an
        # admission may not eat into them, or it would only cause a preemption next step.
        outstanding = sum(self.blocks.num_missing_blocks(s.seq_id, s.num_tokens + 1)
                          for s in self.running if not self._ends_with_pending_token(s))
        now = time.monotonic()
        if self.admission is not None:
            self.admission.begin_admission()
        for seq in sorted(self.waiting, key=self._key):
            if not self.free_slots:
                break
            if self._sibling_computing_prompt(seq):
                continue   # it finds the prompt in the cache once the sibling has computed it
            if self.admission is not None and not self.admission.can_admit(seq):
                continue   # its LoRA adapter has no slot yet; others may still start
            hits = self.kv_cache.computed_blocks(seq)
            need = self.blocks.num_blocks_taken_by(hits, seq.num_tokens + 1)
            if outstanding + need > self.blocks.num_free_blocks:
                break  # do not let a later, smaller request overtake the policy's order
            self.waiting.remove(seq)
            free_before = self.blocks.num_free_blocks
            self.kv_cache.start_from_cache(seq, hits)
            # Parked hits left the free count just now; only the new blocks are still owed.
            outstanding += need - (free_before - self.blocks.num_free_blocks)
            seq.slot = self.free_slots.pop(0)
            if self.admission is not None:
                self.admission.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)

    # ---- prefix caching (the KV cache manager's; the scheduler decides when) ----------------
    def _sibling_computing_prompt(self, seq: Sequence) -> bool:
        """n > 1: a later sample waits while an earlier one of the same request computes the
        cacheable part of their shared prompt, then starts from it instead of computing it too."""
        if (not self.kv_cache.caching or seq.index == 0 or self.config.batching == "static"
                or seq.params.prompt_logprobs is not None):
            return False
        limit = self.kv_cache.cacheable_prefix(seq.num_prompt_tokens)
        return limit > 0 and any(s.request_id == seq.request_id and s.index < seq.index
                                 and s.num_computed_tokens < limit for s in self.running)

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return self.kv_cache.cached_prefix_tokens(token_ids, cache_salt)

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache.prefix_cache_hits

    # ---- step planning -------------------------------------------------------------------
    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Blocks for `num_tokens` tokens of `seq`, preempting the worst unscheduled running
        sequences as needed. False if `seq` itself had to go."""
        while not self.blocks.can_hold(seq.seq_id, num_tokens):
            candidates = [s for s in self.running if s.seq_id not in scheduled]
            victim = max(candidates, key=self._key)
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.ensure_capacity(seq.seq_id, num_tokens)
        return True

    def sampling_row(self, seq: Sequence, ahead: list[int] = ()) -> SamplingRow:
        """The row that samples the sequence's next token; `ahead`: proposed tokens assumed
        accepted before it (a verification row samples what plain decoding would sample there)."""
        p = seq.params
        banned: list[int] = []
        if seq.num_output_tokens + len(ahead) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
        history = seq.prompt_token_ids + seq.output_token_ids + list(ahead) if _uses_penalties(p) else []
        return SamplingRow(
            seq_id=seq.seq_id, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
            min_p=p.min_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            seed=seq.seed, position=seq.num_tokens + len(ahead),
            num_prompt_tokens=seq.num_prompt_tokens, history=history,
            banned_token_ids=banned, logprobs=p.logprobs, logit_bias=p.logit_bias)

    def schedule(self) -> StepPlan:
        self.step_count += 1
        self._admit()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes: list[DecodeEntry] = []
        prefills: list[PrefillChunk] = []
        sampling: dict[int, SamplingRow] = {}
        order = sorted(self.running, key=self._key)

        # Decodes first: one long prompt must never stall everyone's next token.
        for seq in order:
            if (seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1
                    or seq.prefills_last_token):
                continue
            if self._ends_with_pending_token(seq):
                continue
            if not self._reserve(seq, seq.num_tokens, scheduled):
                continue
            position = seq.num_tokens - 1
            decodes.append(DecodeEntry(seq.seq_id, seq.slot, seq.token_at(position), position,
                                       list(self.blocks.block_table(seq.seq_id))))
            sampling[seq.seq_id] = self.sampling_row(seq)
            scheduled.add(seq.seq_id)
            budget -= 1

        # Chunk boundaries depend only on the sequence (never on what else is running), so a
        # request computes the same shapes, and the same numbers, alone or in a crowd.
        for seq in order:
            if (seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled
                    or seq.num_uncomputed_tokens <= (0 if seq.prefills_last_token else 1)):
                continue
            chunk = min(seq.num_uncomputed_tokens, self.config.prefill_chunk_size)
            if chunk > budget:
                continue
            start = seq.num_computed_tokens
            if not self._reserve(seq, start + chunk, scheduled):
                continue
            pools = seq.pooling is not None
            samples = start + chunk == seq.num_tokens and not pools
            wants_prompt_lp = seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
            prefills.append(PrefillChunk(
                seq.seq_id, seq.tokens(start, start + chunk), start,
                list(self.blocks.block_table(seq.seq_id)), samples,
                seq.params.prompt_logprobs if wants_prompt_lp else None, seq.slot, pools))
            if samples:
                sampling[seq.seq_id] = self.sampling_row(seq)
            scheduled.add(seq.seq_id)
            budget -= chunk
        # Speculation: the proposals made after the last update (never proposed here).
        draft_sampling = (self.speculation.attach(self, decodes, budget, sampling)
                          if self.speculation is not None else {})
        return StepPlan(self.step_count, prefills, decodes, sampling, draft_sampling)

    # ---- host/device overlap ----------------------------------------------------------------
    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """A sequence whose last token is still on device and is certain to end it (max_tokens,
        max_model_len) decodes nothing more: that row would only be thrown away."""
        if not seq.output_token_ids or seq.output_token_ids[-1] != PENDING_TOKEN:
            return False
        p = seq.params
        return ((p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
                or seq.num_tokens >= self.config.max_model_len)

    def needs_tokens_to_plan(self, plan: StepPlan, seqs: dict[int, Sequence]) -> bool:
        """Whether the step after `plan` can only be planned once `plan`'s tokens are read:
        proposers read the tokens, penalties count them."""
        if self.speculation is not None:
            return True
        return any(_uses_penalties(seqs[i].params) for i in plan.sampling if i in seqs)

    # ---- results -------------------------------------------------------------------------
    def on_dispatched(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        """The plan's calls are on the device: its tokens count as computed (what runs next on
        the device runs after them), full prefill chunks' blocks become cached, and every
        sequence that samples holds a PENDING_TOKEN until `update` reads the real one.
        Sequences finished (or aborted) since the plan was made are left alone."""
        plan.dispatched = True
        for chunk in plan.prefills:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.is_finished:
                continue
            seq.num_computed_tokens += len(chunk.token_ids)
            self.kv_cache.cache_computed_blocks(seq, chunk.start, len(chunk.token_ids))
        for entry in plan.decodes:
            seq = seqs.get(entry.seq_id)
            if seq is not None and not seq.is_finished:
                seq.num_computed_tokens += 1
        for seq_id in plan.sampling:
            seq = seqs.get(seq_id)
            if seq is not None and not seq.is_finished:
                seq.output_token_ids.append(PENDING_TOKEN)

    def update(self, plan: StepPlan, result: StepResult, seqs: dict[int, Sequence]) -> list[Sequence]:
        """Applies a dispatched step's results (after `on_dispatched`); returns the sequences
        that got a new token. Tokens of sequences that finished meanwhile are dropped."""
        if not plan.dispatched:
            self.on_dispatched(plan, seqs)      # a caller stepping without overlap
        now = time.monotonic()
        for chunk in plan.prefills:
            seq = seqs.get(chunk.seq_id)
            for position, logprobs in result.prompt_logprobs.get(chunk.seq_id, ()):
                if seq is not None and position < seq.num_prompt_tokens:
                    seq.prompt_logprobs[position] = logprobs
        advanced = self._apply_pooled(plan, result, seqs)
        drafts = {d.seq_id: d.draft_token_ids for d in plan.decodes if d.draft_token_ids}
        for seq_id, sampled in result.sampled.items():
            seq = seqs.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            assert seq.output_token_ids[-1] == PENDING_TOKEN, "a sampled token with no place"
            seq.output_token_ids.pop()
            self.append_token(seq, sampled, now)
            if seq_id in drafts:
                self.speculation.accept(self, seq, drafts[seq_id], result.draft_sampled[seq_id])
            advanced.append(seq)
        if self.speculation is not None:
            # The step's tokens are in: the next step's proposals (a draft model runs here,
            # after sampling as in vLLM V1, never while a step is planned).
            self.speculation.propose_next(self)
        return advanced

    def _apply_pooled(self, plan: StepPlan, result: StepResult,
                      seqs: dict[int, Sequence]) -> list[Sequence]:
        """Embedding requests: each pooled chunk's vector is kept on its sequence; the chunk
        ending the prompt finishes it (its blocks and slot freed at once). -> those finished."""
        finished = []
        for chunk in plan.prefills:
            seq = seqs.get(chunk.seq_id)
            if not chunk.pool or seq is None or seq.is_finished:
                continue
            seq.pooled[chunk.start] = result.pooled[chunk.seq_id]
            if chunk.start + len(chunk.token_ids) == seq.num_tokens:
                now = time.monotonic()
                seq.first_token_time = seq.last_token_time = now
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
                finished.append(seq)
        return finished

    def decode_ready(self) -> list[Sequence]:
        """The running sequences the next plan will decode (one uncomputed token each, none
        ending on a token still on device), in the policy's order; preemption may drop some."""
        return [seq for seq in sorted(self.running, key=self._key)
                if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
                and not seq.prefills_last_token and not self._ends_with_pending_token(seq)]

    def decodes_may_preempt(self, decoding: list[Sequence]) -> bool:
        """Whether planning these decodes may preempt some of them: their next tokens need
        more blocks than are free (admission never takes blocks running sequences need)."""
        missing = sum(self.blocks.num_missing_blocks(s.seq_id, s.num_tokens) for s in decoding)
        return missing > self.blocks.num_free_blocks

    def append_token(self, seq: Sequence, sampled: SampledToken, now: float | None = None) -> None:
        seq.output_token_ids.append(sampled.token_id)
        if seq.params.logprobs is not None:
            top = dict(list((sampled.top_logprobs or {}).items())[: seq.params.logprobs])
            top[sampled.token_id] = sampled.logprob
            seq.output_logprobs.append(top)
        now = time.monotonic() if now is None else now
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self._apply_token_stops(seq)

    def _apply_token_stops(self, seq: Sequence) -> None:
        p = seq.params
        token = seq.output_token_ids[-1]
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.finish(seq, SequenceStatus.FINISHED_STOPPED, None)
            if token in p.stop_token_ids:
                return self.finish(seq, SequenceStatus.FINISHED_STOPPED, token)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        if seq.num_tokens >= self.config.max_model_len:
            return self.finish(seq, SequenceStatus.FINISHED_LENGTH)


def _uses_penalties(p) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0
