"""The output processor: text, stop strings and `RequestOutput`s, after the scheduler's update.

It owns each request's `RequestState` (its sequences, one per completion, and their
incremental detokenizers) from `add_request` until the request's final output. Each step it
is handed the sequences that got tokens; it decodes them, finds stop strings, and returns
verdicts (which sequence stops, on which string) that the engine hands to the scheduler — it
never changes the scheduler itself — then builds the outputs. Pure Python, no JAX."""
from __future__ import annotations

import dataclasses

from jaxbatch.engine.detokenizer import IncrementalDetokenizer
from jaxbatch.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.core.request import Sequence, SequenceStatus
from jaxbatch.reasoning.split import ReasoningSplit
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
    # A reasoning model's thought, split from the text (jaxbatch/reasoning/); None: no parser.
    reasoning: ReasoningSplit | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def find_stop_string(self, seq: Sequence, tokenizer) -> str | None:
        """Decodes the sequence's new tokens (jaxbatch/engine/detokenizer.py) and returns the
        stop string that ends it, if it is still running and one appeared: the caller finishes
        it. The tokens after the one completing the stop string are cut (an accepted
        speculative run may hold several); its text is cut before the stop string."""
        if tokenizer is None:
            return None
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
        if stop is None or seq.status is SequenceStatus.FINISHED_ABORTED:
            return None
        if seq.is_finished:   # the same token also ended it by length or EOS: a stop, then
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            return None
        return stop

    def _text(self, seq: Sequence) -> str:
        """Finished: the whole text (without the stop string). Running: the part that is safe
        to stream, i.e. without the tail that could still begin a stop string."""
        detok = self.detoks.get(seq.index)
        if detok is None:
            return self.texts[seq.index]
        if seq.is_finished:
            detok.update(seq.output_token_ids, final=True)   # aborted: flush what is left
        return detok.output_text(seq.is_finished)

    def _split(self, seq: Sequence) -> tuple[str | None, str]:
        """(reasoning, text): the thought apart, with a reasoning parser."""
        text = self._text(seq)
        if self.reasoning is None or not seq.params.split_reasoning:
            return None, text
        return self.reasoning.split(text, seq.is_finished)

    def make_output(self) -> RequestOutput:
        seqs = self.seqs
        completions = [CompletionOutput(
            index=s.index, text=text, token_ids=list(s.output_token_ids),
            logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason, reasoning=reasoning)
            for s in seqs for reasoning, text in [self._split(s)]]
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


class OutputProcessor:
    """Every unfinished request's state, keyed by request id."""

    def __init__(self, tokenizer, reasoning=None):
        """`reasoning`: the engine's ReasoningParser, or None."""
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        if self.reasoning is not None:     # where the output starts: read from the prompt's end
            phase = self.reasoning.first_phase(state.prompt_token_ids, self.tokenizer.decode)
            state.reasoning = ReasoningSplit(self.reasoning, phase)
        self.requests[state.request_id] = state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def stop_strings(self, advanced: list[Sequence]) -> list[tuple[Sequence, str]]:
        """Verdicts for this step's advanced sequences: (sequence, stop string) to finish."""
        verdicts = []
        for seq in advanced:
            stop = self.requests[seq.request_id].find_stop_string(seq, self.tokenizer)
            if stop is not None:
                verdicts.append((seq, stop))
        return verdicts

    def outputs(self, advanced: list[Sequence]) -> tuple[list[RequestOutput], list[Sequence]]:
        """One output per request that advanced, in order; returns the outputs and the
        sequences of requests that just finished (the engine forgets them)."""
        outputs, done = [], []
        for rid in dict.fromkeys(seq.request_id for seq in advanced):
            state = self.requests[rid]
            outputs.append(state.make_output())
            if state.finished:
                del self.requests[rid]
                done += state.seqs
        return outputs, done

    def abort(self, request_id: str) -> RequestState | None:
        """Forgets the request; its state (to finish its sequences and build the final output)."""
        return self.requests.pop(request_id, None)
