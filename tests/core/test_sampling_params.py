"""SamplingParams validation: every invalid value raises ValueError naming the field."""
from __future__ import annotations

import math

import pytest

from jaxbatch import SamplingParams
from jaxbatch.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

INVALID = [
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=-1e-6)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=1.0001)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("n", dict(n=0)),
    ("n", dict(n=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=2.01)),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=-1)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", dict(logprobs=1.0)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=MAX_LOGPROBS + 1)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[1, "2"])),
    ("seed", dict(seed="7")),
    ("seed", dict(seed=1.5)),
    ("logit_bias", dict(logit_bias=[(5, 1.0)])),
    ("logit_bias", dict(logit_bias={5: 100.5})),
    ("logit_bias", dict(logit_bias={5: -101})),
    ("logit_bias", dict(logit_bias={5: math.inf})),
    ("logit_bias", dict(logit_bias={5: "1"})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"5": 1.0})),
    ("logit_bias", dict(logit_bias={True: 1.0})),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})),
]


@pytest.mark.parametrize("field, kwargs", INVALID, ids=[f"{f}-{kw}" for f, kw in INVALID])
def test_invalid_value_raises_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_defaults_are_valid_and_match_the_api():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (16, 0, [], [], False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logprobs, p.prompt_logprobs, p.skip_special_tokens) == (None, None, True)
    assert not p.greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=1), dict(min_p=0.0),
    dict(min_p=1.0), dict(max_tokens=1), dict(max_tokens=None, min_tokens=50),
    dict(min_tokens=16, max_tokens=16), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(repetition_penalty=0.01), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS),
    dict(prompt_logprobs=0), dict(seed=0), dict(n=4), dict(stop_token_ids=[0, 5]),
    dict(logit_bias={0: -100, 7: 100.0, 9: 0}),
    dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_string_becomes_a_list_and_none_becomes_empty():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=("a",)).stop == ["a"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_validate_catches_fields_changed_after_construction():
    # LLMEngine.add_request re-validates, so a params object mutated after creation is caught.
    p = SamplingParams()
    p.temperature = -2
    with pytest.raises(ValueError, match="temperature"):
        p._validate()


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_nan_is_rejected(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: math.nan})
