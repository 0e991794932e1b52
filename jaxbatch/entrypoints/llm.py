"""LLM: the offline entry point, vLLM-shaped: generate() and chat() over an LLMEngine."""
from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from jaxbatch.engine.build import build_engine
from jaxbatch.engine.interface import EngineClient
from jaxbatch.lora.request import per_request
from jaxbatch.outputs import EmbeddingRequestOutput, RequestOutput
from jaxbatch.pooling_params import PoolingParams
from jaxbatch.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        """`engine_kwargs`: the engine options (jaxbatch/engine/config.py), plus `loaded=` /
        `runner=` to share weights or compiled steps."""
        self.llm_engine: EngineClient = build_engine(model, **engine_kwargs)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: EngineClient) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 priority: list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """`prompts`: a str, a list of str, or a list of token-id lists. Outputs in input order.
        `lora_request`: a LoRARequest for every prompt, or a list (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority", default=0)
        loras = per_request(lora_request, len(prompts))
        return self._run(list(zip(prompts, params, priorities, loras)), use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: list[int] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Embeddings (an engine built with runner="pooling"): `prompts` as for `generate`;
        each output's `.outputs.embedding` is a list of floats, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(pooling_params, len(prompts), "pooling_params",
                             default=PoolingParams())
        priorities = _per_prompt(priority, len(prompts), "priority", default=0)
        return self._run([(p, pp, prio, None) for p, pp, prio in zip(prompts, params, priorities)],
                         use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             lora_request=None) -> list[RequestOutput]:
        """`messages`: one conversation (list of {"role", "content"}) or a list of them."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **(chat_template_kwargs or {}))
                   for conv in conversations]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p)
                   for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        if not engine.is_leader:
            # Another process of a multi-process engine: process 0 has the requests and the
            # outputs; this one steps with it until its batch is done.
            engine.follow()
            return []
        try:
            return self._generate(engine, requests, use_tqdm)
        finally:
            engine.release()

    def _generate(self, engine, requests, use_tqdm: bool) -> list[RequestOutput]:
        # All or nothing: check the whole batch before adding any of it.
        ids = [str(next(self._ids)) for _ in requests]
        for rid, (prompt, params, prio, lora) in zip(ids, requests):
            engine.validate_request(rid, prompt, params, prio, lora_request=lora)
        for rid, (prompt, params, prio, lora) in zip(ids, requests):
            engine.add_request(rid, prompt, params, priority=prio, lora_request=lora)
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="Processed prompts") as bar:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in ids]


def _per_prompt(value, n: int, name: str, default=None):
    if value is None:
        value = SamplingParams() if name == "sampling_params" else default
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} given for {n} prompts")
        return value
    return [value] * n
