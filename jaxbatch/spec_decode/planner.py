"""The scheduler's speculative decoding (jaxbatch/spec_decode/speculative.py has the settings and the
proposers): which decoding sequences get proposals this step, from what the step leaves over,
and how many of them stand once the step's samples are back. Mixed into `Scheduler`; pure
Python, no JAX."""
from __future__ import annotations

from jaxbatch.core.plan import DecodeEntry, SampledToken, SamplingRow
from jaxbatch.core.request import Sequence
from jaxbatch.spec_decode.speculative import draft_probs

MAX_SPEC_BACKOFF = 16


class SpeculativeScheduling:
    """Uses the Scheduler's speculative, proposer, spec_counters, running, blocks, config,
    step_count, _sampling_row and _append."""

    def _speculate(self, decodes: list[DecodeEntry], budget: int,
                   sampling: dict[int, SamplingRow]) -> dict[int, list[SamplingRow]]:
        """Proposals for small decode batches, from what is left after everything else: the
        token budget, rows of the largest decode bucket, free blocks (never a preemption)."""
        spec = self.speculative
        if not decodes or len(decodes) > spec.max_batch_size:
            return {}
        by_id = {s.seq_id: s for s in self.running}
        rows_left = self.config.max_num_seqs - len(decodes)
        wanted = {}
        for entry in decodes:
            seq = by_id[entry.seq_id]
            p = seq.params
            # Every proposal accepted still leaves room for the sample after it.
            k = min(spec.num_speculative_tokens, budget, rows_left,
                    self.config.max_model_len - seq.num_tokens - 1)
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - seq.num_output_tokens - 1)
            if k <= 0 or not p.speculate or self.step_count < seq.spec_resume_step:
                continue
            wanted[seq.seq_id] = (seq.prompt_token_ids + seq.output_token_ids, k)
            budget -= k
            rows_left -= k
        # The sequences' sampling rows: a sampled draft draws with their settings.
        proposals = (self.proposer.propose_batch(wanted, {sid: sampling[sid] for sid in wanted})
                     if wanted else {})
        draft_sampling = {}
        for entry in decodes:
            seq, raw = by_id[entry.seq_id], proposals.get(entry.seq_id, ())
            proposal = list(raw)
            while proposal and not self.blocks.can_hold(seq.seq_id, seq.num_tokens + len(proposal)):
                proposal.pop()
            if not proposal:
                continue
            self.blocks.ensure_capacity(seq.seq_id, seq.num_tokens + len(proposal))
            entry.block_table = list(self.blocks.block_table(seq.seq_id))
            entry.draft_token_ids = proposal
            entry.draft_probs = draft_probs(raw, len(proposal))
            draft_sampling[seq.seq_id] = [self._sampling_row(seq, proposal[:i])
                                          for i in range(1, len(proposal) + 1)]
        return draft_sampling

    def _accept(self, seq: Sequence, drafts: list[int], samples: list[SampledToken]) -> None:
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
            self._append(seq, sampled)
        self.spec_counters.record(len(drafts), accepted)
        # A rejected row costs about what a decoding sequence does on a CPU: a sequence whose
        # proposals are mostly wrong (its text does not repeat) stops proposing for a while
        # (1, 2, 4 .. MAX_SPEC_BACKOFF steps); a mostly accepted proposal resumes it at once.
        paid_off = 2 * accepted >= len(drafts)
        seq.spec_backoff = 0 if paid_off else min(MAX_SPEC_BACKOFF, max(1, 2 * seq.spec_backoff))
        seq.spec_resume_step = self.step_count + 1 + seq.spec_backoff
        if not seq.is_finished:
            self.blocks.shrink(seq.seq_id, seq.num_tokens)
