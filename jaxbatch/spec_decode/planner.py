"""The speculative planner: the seam between speculative decoding and the scheduler.

The engine hands one to the scheduler (`Scheduler(..., speculation=planner)`); the scheduler
calls it three times a step and knows nothing else of speculation: `accept` when a verified
sequence's samples are back (how many proposals stand), `propose_next` at the end of
`Scheduler.update`, once the step's tokens are applied (the proposer, a draft engine perhaps,
runs here: as vLLM V1 proposes drafts after sampling, never while a step is planned), and
`attach` when the next step's decodes and prefills are planned (which proposals ride in it,
trimmed to what the step leaves over). It reaches the scheduler only through its public
methods (`running`, `decode_ready`, `decodes_may_preempt`, `blocks`, `config`, `step_count`, `sampling_row`,
`append_token`). Settings and proposers are in `speculative.py`; the draft-model proposer in
`draft_model.py`. Pure Python, no JAX."""
from __future__ import annotations

from jaxbatch.core.plan import DecodeEntry, SampledToken, SamplingRow
from jaxbatch.core.request import Sequence
from jaxbatch.spec_decode.speculative import (SampledDraft, SpecCounters, SpeculativeConfig,
                                              draft_probs, make_proposer)

MAX_SPEC_BACKOFF = 16


class SpeculativePlanner:
    def __init__(self, config: SpeculativeConfig, proposer=None):
        """`proposer`: overrides the one `config` names (the engine builds draft models)."""
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.counters = SpecCounters()
        # seq_id -> (its token count when proposed, the proposal): made by `propose_next`
        # after an update, used by the next plan's `attach`.
        self._ready: dict[int, tuple[int, list[int]]] = {}

    def _limit(self, sched, seq: Sequence, step: int) -> int:
        """The most proposals `seq` may carry in step `step` from its own limits (0: none):
        every proposal accepted still leaves room for the sample after it."""
        p = seq.params
        k = min(self.config.num_speculative_tokens, sched.config.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        if not p.speculate or step < seq.spec_resume_step:
            return 0
        return k

    def propose_next(self, sched) -> None:
        """After an update: proposals for the sequences the next step will decode, each as long
        as its own limits allow (`attach` trims them to the step's budget; a prefix of a
        proposal is the proposal of that length). Made only while the next step can speculate
        (at most `max_batch_size` decoding sequences)."""
        self._ready = {}
        ready = sched.decode_ready()
        if len(ready) > self.config.max_batch_size:
            if not sched.decodes_may_preempt(ready):
                return
            # Preemption may leave few enough to speculate. It takes the policy's worst first,
            # so the survivors are the first of `ready`.
            ready = ready[:self.config.max_batch_size]
        wanted, rows = {}, {}
        for seq in ready:
            k = self._limit(sched, seq, sched.step_count + 1)
            if k > 0:
                wanted[seq.seq_id] = (seq.prompt_token_ids + seq.output_token_ids, k)
                # The sequence's sampling row: a sampled draft draws with its settings.
                rows[seq.seq_id] = sched.sampling_row(seq)
        proposals = self.proposer.propose_batch(wanted, rows) if wanted else {}
        self._ready = {sid: (len(wanted[sid][0]), proposal)
                       for sid, proposal in proposals.items()}

    def attach(self, sched, decodes: list[DecodeEntry], budget: int,
               sampling: dict[int, SamplingRow]) -> dict[int, list[SamplingRow]]:
        """The proposals for a planned step's decodes, from what is left after everything else:
        the token budget, rows of the largest decode bucket, free blocks (never a preemption).
        Fills each proposed DecodeEntry's drafts; returns the verification rows' sampling."""
        spec = self.config
        if not decodes or len(decodes) > spec.max_batch_size:
            return {}
        by_id = {s.seq_id: s for s in sched.running}
        rows_left = sched.config.max_num_seqs - len(decodes)
        proposals = {}
        for entry in decodes:
            seq = by_id[entry.seq_id]
            k = min(self._limit(sched, seq, sched.step_count), budget, rows_left)
            if k <= 0:
                continue
            made_for, raw = self._ready.get(seq.seq_id, (None, ()))
            if made_for == seq.num_tokens:     # (never a proposal made for older tokens)
                proposals[seq.seq_id] = _first(raw, k)
            budget -= k
            rows_left -= k
        draft_sampling = {}
        for entry in decodes:
            seq, raw = by_id[entry.seq_id], proposals.get(entry.seq_id, ())
            proposal = list(raw)
            while proposal and not sched.blocks.can_hold(seq.seq_id, seq.num_tokens + len(proposal)):
                proposal.pop()
            if not proposal:
                continue
            sched.blocks.ensure_capacity(seq.seq_id, seq.num_tokens + len(proposal))
            entry.block_table = list(sched.blocks.block_table(seq.seq_id))
            entry.draft_token_ids = proposal
            entry.draft_probs = draft_probs(raw, len(proposal))
            draft_sampling[seq.seq_id] = [sched.sampling_row(seq, proposal[:i])
                                          for i in range(1, len(proposal) + 1)]
        return draft_sampling

    def accept(self, sched, seq: Sequence, drafts: list[int],
               samples: list[SampledToken]) -> None:
        """A proposal stands while it equals the token sampled before it; each accepted one
        adds its row's sample. Stops apply token by token, so a run ends where plain decoding
        would end. KV of rejected proposals is dead: never counted computed, overwritten later."""
        if seq.is_finished:
            return     # its own token ended it: the proposals were never in question
        accepted = 0
        for draft, sampled in zip(drafts, samples):
            if seq.is_finished or seq.output_token_ids[-1] != draft:
                break
            accepted += 1
            seq.num_computed_tokens += 1
            sched.append_token(seq, sampled)
        self.counters.record(len(drafts), accepted)
        # A rejected row costs about what a decoding sequence does on a CPU: a sequence whose
        # proposals are mostly wrong (its text does not repeat) stops proposing for a while
        # (1, 2, 4 .. MAX_SPEC_BACKOFF steps); a mostly accepted proposal resumes it at once.
        paid_off = 2 * accepted >= len(drafts)
        seq.spec_backoff = 0 if paid_off else min(MAX_SPEC_BACKOFF, max(1, 2 * seq.spec_backoff))
        seq.spec_resume_step = sched.step_count + 1 + seq.spec_backoff
        if not seq.is_finished:
            sched.blocks.shrink(seq.seq_id, seq.num_tokens)

    def stats(self) -> dict:
        c = self.counters
        return {"speculative_method": self.config.method, "spec_num_drafts": c.num_drafts,
                "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_position": list(c.accepted_per_position),
                "spec_mean_accepted_length": c.mean_accepted_length}


def _first(proposal, k: int):
    """A proposal's first k tokens, with their q for a sampled draft."""
    if isinstance(proposal, SampledDraft):
        return SampledDraft(proposal[:k], proposal.probs[:k])
    return list(proposal[:k])
