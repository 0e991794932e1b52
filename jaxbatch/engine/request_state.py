"""One request as the engine tracks it: its sequences (one per completion), their incremental
detokenizers and stop strings, and the `RequestOutput` built from them. Pure Python, no JAX."""
from __future__ import annotations

import dataclasses

from jaxbatch.engine.detokenizer import IncrementalDetokenizer
from jaxbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence]
    texts: list[str]
    # One incremental detokenizer per completion (by index), made on its first token: decoding
    # only the new tokens keeps text O(1) per token instead of re-decoding the whole output.
    detoks: dict[int, IncrementalDetokenizer] = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def apply_stop_strings(self, seq: Sequence, tokenizer, finish) -> None:
        """Decodes the sequence's new tokens (jaxbatch/engine/detokenizer.py) and ends it at the first
        stop string, through `finish(seq, status, stop)` (the scheduler's); its text is then cut
        before the stop string (the tokens up to the one completing it stay)."""
        if tokenizer is None:
            return
        detok = self.detoks.get(seq.index)
        if detok is None:
            detok = self.detoks[seq.index] = IncrementalDetokenizer(
                tokenizer, seq.params.skip_special_tokens, seq.params.stop)
        ids = seq.output_token_ids
        stop, end = None, detok.num_seen
        # Several new tokens (an accepted speculative run): one at a time, so a stop string
        # ends the output at the token where plain decoding would have ended it.
        while stop is None and end < len(ids) - 1 and seq.params.stop:
            end += 1
            stop = detok.update(ids[:end])
        if stop is None:
            end = len(ids)
            stop = detok.update(ids, final=seq.is_finished)
        elif end < len(ids):
            del ids[end:]
            del seq.output_logprobs[end:]
        if stop is not None and seq.status is not SequenceStatus.FINISHED_ABORTED:
            if seq.is_finished:   # the same token also ended it by length or EOS
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            else:
                finish(seq, SequenceStatus.FINISHED_STOPPED, stop)

    def _text(self, seq: Sequence) -> str:
        """Finished: the whole text (without the stop string). Running: the part that is safe
        to stream, i.e. without the tail that could still begin a stop string."""
        detok = self.detoks.get(seq.index)
        if detok is None:
            return self.texts[seq.index]
        if seq.is_finished:
            detok.update(seq.output_token_ids, final=True)   # aborted: flush what is left
        return detok.output_text(seq.is_finished)

    def make_output(self) -> RequestOutput:
        seqs = self.seqs
        completions = [CompletionOutput(
            index=s.index, text=self._text(s), token_ids=list(s.output_token_ids),
            logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in seqs]
        times = lambda attr: [getattr(s, attr) for s in seqs if getattr(s, attr) is not None]  # noqa: E731
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(times("first_scheduled_time"), default=None),
            first_token_time=min(times("first_token_time"), default=None),
            last_token_time=max(times("last_token_time"), default=None),
            finished_time=max(times("finished_time"), default=None) if self.finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs))
        prompt_lp = list(seqs[0].prompt_logprobs) if self.params.prompt_logprobs is not None else None
        # The first sample's: what earlier requests left in the cache (later samples of the
        # same request start from the prompt the first one computed; that is not a hit).
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             prompt_lp, completions, self.finished, metrics,
                             num_cached_tokens=seqs[0].num_cached_tokens or 0)
