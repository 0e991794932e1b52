"""Embedding requests in the engine: the pooler it runs with, and each request's state from
`add_request` to its `EmbeddingRequestOutput`. Host only (numpy).

The device reduces each of a request's prefill chunks to one vector (`worker/pooling.py`);
the scheduler keeps them on the sequence by chunk start and finishes the sequence when its
last chunk is read (`Scheduler._apply_pooled`). Here they become the request's embedding:
the last chunk's ("last"), the first's ("cls") or their sum over the prompt's length
("mean"), then truncated to `dimensions` (Matryoshka) and scaled to unit length where the
model normalizes (truncation first, as sentence-transformers' `truncate_dim` and vLLM do).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxbatch.core.request import Sequence
from jaxbatch.engine.config import EngineConfig
from jaxbatch.model.sentence_transformers import read_pooling
from jaxbatch.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxbatch.pooling_params import PoolerConfig, PoolingParams
from jaxbatch.sampling_params import SamplingParams

# What an embedding sequence carries as its `params` (the scheduler reads cache and logprob
# settings off every sequence): nothing sampled, nothing cached under a salt.
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


def make_pooler(config: EngineConfig, loaded, runner) -> tuple[PoolerConfig | None, bool]:
    """A pooling engine's pooler, its runner told to pool that way (its "pool" executables
    compiled at warm-up like every other) -> (pooler or None, whether keys were added)."""
    pooler = pooler_config(config, loaded.source, loaded.config.hidden_size)
    if pooler is None:
        if runner.pooling_type is not None:
            raise ValueError("runner= belongs to a pooling engine: a generating engine cannot "
                             "share it")
        return None, False
    return pooler, runner.enable_pooling(pooler.pooling_type)


def checked_params(pooler: PoolerConfig | None, params):
    """SamplingParams for a generating engine (`pooler` None), PoolingParams for a pooling
    one; None: the default of the engine's kind. ValueError for the other kind or bad
    values (a `dimensions` the model was not trained for)."""
    if pooler is None:
        if isinstance(params, PoolingParams):
            raise ValueError("embeddings need an engine built with runner='pooling'")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        params._validate()
        return params
    params = PoolingParams() if params is None else params
    if not isinstance(params, PoolingParams):
        raise ValueError("this engine was built with runner='pooling': it computes embeddings "
                         "(LLM.embed, PoolingParams), it does not generate")
    params._validate()
    pooler.check_dimensions(params.dimensions)
    return params


def pooler_config(config: EngineConfig, source: str, hidden_size: int) -> PoolerConfig | None:
    """The engine's pooler: the options first, then the checkpoint's sentence-transformers
    files (`model/sentence_transformers.py`), then last-token pooling, normalized (what
    decoder embedding models use). None for a generating engine."""
    options = config.pooling
    if options.runner != "pooling":
        return None
    checkpoint = read_pooling(source)
    return PoolerConfig(
        pooling_type=options.pooling_type or checkpoint.pooling_type or "last",
        normalize=_first_set(options.pooling_normalize, checkpoint.normalize, True),
        hidden_size=hidden_size, matryoshka_dimensions=checkpoint.matryoshka_dimensions)


def _first_set(*values):
    return next(v for v in values if v is not None)


def embedding(pooler: PoolerConfig, seq: Sequence) -> list[float]:
    """A finished embedding sequence's chunks (`seq.pooled`, by start) -> its embedding."""
    starts = sorted(seq.pooled)
    if pooler.pooling_type == "last":
        vector = np.asarray(seq.pooled[starts[-1]], np.float64)
    elif pooler.pooling_type == "cls":
        vector = np.asarray(seq.pooled[starts[0]], np.float64)
    else:
        vector = sum(np.asarray(seq.pooled[s], np.float64) for s in starts) / seq.num_tokens
    dimensions = seq.pooling.dimensions
    if dimensions is not None:
        vector = vector[:dimensions]
    if pooler.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32).tolist()


@dataclasses.dataclass
class EmbeddingState:
    """An embedding request in the output processor (what `RequestState` is for text)."""
    request_id: str
    prompt_token_ids: list[int]
    pooler: PoolerConfig
    seqs: list[Sequence]
    params: PoolingParams

    @classmethod
    def of(cls, seq_id: int, request_id: str, ids: list[int], params: PoolingParams,
           pooler: PoolerConfig, priority: int, now: float) -> "EmbeddingState":
        """A new request's state, holding its one prefill-only sequence."""
        seq = Sequence(seq_id, request_id, 0, ids, PREFILL_ONLY, 0, now, 0, priority,
                       pooling=params)
        return cls(request_id, ids, pooler, [seq], params)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def find_stop_string(self, seq: Sequence, tokenizer) -> None:
        return None                  # no text

    def make_output(self) -> EmbeddingRequestOutput:
        """Finished: the embedding; aborted before it was computed: an empty one."""
        seq = self.seqs[0]
        done = seq.is_finished and seq.pooled and seq.finish_reason != "abort"
        return EmbeddingRequestOutput(
            self.request_id, EmbeddingOutput(embedding(self.pooler, seq) if done else []),
            list(self.prompt_token_ids), self.finished)
