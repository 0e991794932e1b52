"""Structured outputs offline, on the embedded model: JSON schema / regex / choice / grammar
outputs satisfy their constraint, every sampled token was allowed by a fresh matcher replaying
the output, bad grammars are a ValueError that changes nothing, and constrained neighbours
change nothing for free requests (greedy tokens, compilations, blocks)."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams, StructuredOutputsParams
from jaxbatch.engine.llm_engine import LLMEngine

MAX_MODEL_LEN = 512

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(embedded):
    return LLM(loaded=embedded, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)


def chat_prompt(llm, text):
    tok = llm.get_tokenizer()
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


def so_params(seed, max_tokens=80, temperature=1.0, **so):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


def replay_allowed(llm, so: StructuredOutputsParams, token_ids, eos_ids):
    """A fresh matcher (built here, not the engine's) checks each token before consuming it;
    EOS must come only where the grammar accepts."""
    import llguidance.hf
    import llguidance.numpy as lln
    from llguidance import LLMatcher
    from jaxbatch.structured.grammar import grammar_for
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    tok = llguidance.hf.from_tokenizer(llm.get_tokenizer(), n_vocab=vocab, eos_token=list(eos_ids))
    matcher = LLMatcher(tok, grammar_for(so))
    mask = lln.allocate_token_bitmask(1, vocab)
    for t in token_ids:
        lln.fill_next_token_bitmask(matcher, mask, 0)
        assert (mask[0, t >> 5] >> (t & 31)) & 1, f"token {t} was not allowed"
        if t in eos_ids:
            assert matcher.is_accepting()
            return
        assert matcher.consume_token(t)
    assert matcher.is_accepting()


def test_params_shape():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    for conflicting in (dict(min_tokens=2), dict(ignore_eos=True)):
        with pytest.raises(ValueError, match=next(iter(conflicting))):
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **conflicting)


def test_preemption_feeds_no_token_twice(llm):
    """A recompute preemption keeps the tokens and drops the KV: the matcher, counting what it
    consumed, takes nothing again; and it refuses nothing along the way."""
    from jaxbatch.core.plan import PENDING_TOKEN
    from jaxbatch.core.request import Sequence
    engine = llm.llm_engine
    manager = engine.structured
    tok = llm.get_tokenizer()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["abc-def"]))
    seq = Sequence(10 ** 6, "preempted", 0, [1, 2, 3], params, 0, 0.0, 0, 0)
    manager.add(seq)
    try:
        ids = tok.encode("abc-def", add_special_tokens=False)
        seq.output_token_ids += ids[:1] + [PENDING_TOKEN]
        manager.advance(seq)                          # the pending token is not fed
        assert manager._seqs[seq.seq_id].consumed == 1
        seq.output_token_ids[-1:] = ids[1:]
        manager.advance(seq)
        seq.num_computed_tokens = 0                   # what Scheduler._preempt does to it
        manager.advance(seq)
        manager.advance(seq)
        assert manager._seqs[seq.seq_id].consumed == len(ids)
        assert manager.num_rejected_tokens == 0
        eos = engine.eos_token_ids[0]
        assert manager.is_allowed(seq.seq_id, eos)    # the choice is complete: EOS allowed
        assert not manager.is_allowed(seq.seq_id, ids[0])
    finally:
        manager.remove(seq.seq_id)


@pytest.mark.parametrize("so, message", [
    (dict(json={"type": "foo"}), "Invalid type"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="[a-"), "unclosed character class"),
    (dict(grammar="start: foo"), "unknown name"),
])
def test_invalid_grammar_is_value_error_and_changes_nothing(llm, so, message):
    engine = llm.llm_engine
    engine.add_request("ok", "Hello", SamplingParams(max_tokens=2, temperature=0))
    before = (engine.get_num_unfinished_requests(), engine.stats()["num_free_blocks"],
              engine.structured.num_sequences)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "Hello", SamplingParams(
            structured_outputs=StructuredOutputsParams(**so)))
    assert (engine.get_num_unfinished_requests(), engine.stats()["num_free_blocks"],
            engine.structured.num_sequences) == before
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]


def test_json_schema_temperature_one_finishes_and_validates(llm):
    prompt = chat_prompt(llm, "Describe a person as JSON with name, age and tags.")
    seeds = [1, 2, 3, 4]
    outs = llm.generate([prompt] * len(seeds), [so_params(s, json=PERSON) for s in seeds],
                        use_tqdm=False)
    eos = llm.llm_engine.eos_token_ids
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
        # compact separators, no free whitespace
        assert c.text == json.dumps(json.loads(c.text), separators=(",", ":"), ensure_ascii=False)
        replay_allowed(llm, StructuredOutputsParams(json=PERSON), c.token_ids, eos)
    stats = llm.llm_engine.stats()
    assert stats["structured_num_mask_fills"] > 0 and stats["structured_mask_seconds"] > 0
    assert stats["structured_compile_seconds"] > 0
    assert stats["structured_num_rejected_tokens"] == 0
    # host/device overlap: masks filled while the forward ran, the previous step read then
    assert stats["structured_num_overlapped_fills"] > 0
    assert stats["structured_num_sequences"] == 0          # matchers dropped with the requests


def test_regex_choice_grammar_json_object(llm):
    eos = llm.llm_engine.eos_token_ids
    prompt = chat_prompt(llm, "Give me a code like 123-abcd.")
    regex = r"[0-9]{3}-[a-z]{4}"
    cases = [(StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
             (StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
              lambda t: t in ("yes", "no", "maybe so")),
             (StructuredOutputsParams(grammar='start: "A" /[0-9]{2}/ "!"'),
              lambda t: re.fullmatch(r"A[0-9]{2}!", t)),
             (StructuredOutputsParams(json_object=True),
              lambda t: isinstance(json.loads(t), dict))]
    for seed in (5, 6):
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=48, structured_outputs=so)
                  for so, _ in cases]
        outs = llm.generate([prompt] * len(cases), params, use_tqdm=False)
        for (so, ok), out in zip(cases, outs):
            c = out.outputs[0]
            # an unbounded object may run out of tokens: it is closed within them
            assert (c.finish_reason == "stop" or so.json_object) and ok(c.text), (so, c.text)
            replay_allowed(llm, so, c.token_ids, eos)


def test_mixed_batch_free_requests_unchanged(llm):
    engine = llm.llm_engine
    free = [chat_prompt(llm, "Name three colors."), chat_prompt(llm, "What is 2 + 2?")]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
    constrained = [chat_prompt(llm, "A person as JSON."), chat_prompt(llm, "yes or no?")]
    params = [greedy, so_params(0, temperature=0, json=PERSON), greedy,
              so_params(0, temperature=0, choice=["yes", "no"])]
    outs = llm.generate([free[0], constrained[0], free[1], constrained[1]], params, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)
    assert outs[3].outputs[0].text in ("yes", "no")
    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_speculation_and_prefix_cache_keep_outputs_valid(llm, embedded):
    """Constrained requests are speculated too: each verification row samples under the
    grammar after the proposals before it, rejected ones never reach the matcher. The prefix
    cache serves the shared prompt."""
    spec = LLMEngine(loaded=embedded, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                     runner=llm.llm_engine.runner,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                     prefix_cache_granularity="block")
    prompt = chat_prompt(llm, 'Repeat this JSON exactly: {"name":"Bob","age":30,'
                              '"tags":["red","blue"]} and again {"name":"Bob","age":30,'
                              '"tags":["red","blue"]}')
    spec_llm = LLM.from_engine(spec)
    spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    so = StructuredOutputsParams(json=PERSON)
    params = [so_params(0, temperature=0, json=PERSON), so_params(9, json=PERSON)]
    outs = spec_llm.generate([prompt] * 2, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
        replay_allowed(llm, so, out.outputs[0].token_ids, spec.eos_token_ids)
    stats = spec.stats()
    # only constrained requests ran: their proposals were verified, some accepted
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["structured_num_rejected_tokens"] == 0
    free = spec_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert free[0].outputs[0].token_ids == llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].token_ids
    stats = spec.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_compilations_after_warmup"] == 0


def test_verification_rows_get_the_masks_after_the_proposals_before_them(llm):
    """Each row's mask equals a fresh matcher's after the proposals before it; rows past a
    proposal the grammar refuses stay all ones; the matcher is left where it was."""
    import llguidance.numpy as lln
    from jaxbatch.core.plan import SamplingRow
    from jaxbatch.core.request import Sequence
    manager = llm.llm_engine.structured
    tok = llm.get_tokenizer()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[0-9]+x"))
    one, two, x, three = (tok.encode(t, add_special_tokens=False)[0] for t in ("1", "2", "x", "3"))
    seq = Sequence(10 ** 6 + 1, "drafted", 0, [1, 2], params, 0, 0.0, 0, 0)
    manager.add(seq)
    try:
        row = lambda pos: SamplingRow(seq.seq_id, 0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, pos, 2,  # noqa: E731
                                      [], [], None)
        rows = [None, row(2), row(3), row(4), row(5), row(6)]
        drafts = [one, two, x, three]             # 3 is refused after "12x": row 6 free
        mask = manager.fill_bitmask(rows, {seq.seq_id: drafts})
        fresh = manager._compile(params).deep_copy()
        expect = lln.allocate_token_bitmask(1, manager.vocab_size)
        for j, tokens in enumerate([[], [one], [one, two], [one, two, x]]):
            m = fresh.deep_copy()
            assert m.consume_tokens(tokens)
            lln.fill_next_token_bitmask(m, expect, 0)
            assert (mask[1 + j] == expect[0]).all(), j
        assert (mask[0] == -1).all() and (mask[5] == -1).all()
        bit = lambda r, t: (mask[r, t >> 5] >> (t & 31)) & 1   # noqa: E731
        assert not bit(1, x) and bit(2, x) and bit(4, llm.llm_engine.eos_token_ids[0])
        again = manager.fill_bitmask([row(2)])
        assert (again[0] == mask[1]).all()        # the drafts were rolled back
        assert manager.is_allowed(seq.seq_id, one) and not manager.is_allowed(seq.seq_id, x)
    finally:
        manager.remove(seq.seq_id)


def test_structured_room_imports_no_jax():
    import subprocess
    import sys
    code = ("import sys, jaxbatch.structured; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
