"""SamplingParams, named and validated as in vLLM. Pure Python."""
from __future__ import annotations

import dataclasses
import math

# Top-k log-probabilities are computed on device for a fixed k; requests may ask for fewer.
MAX_LOGPROBS = 20
# logit_bias rides to the sampler as fixed-width per-row arrays (OpenAI's cap on its entries).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's names: exactly one constraint. Only its shape is checked here (pure Python); the
    schema, regex or grammar itself is compiled and checked by the engine's grammar backend
    (jaxbatch/structured/), whose error reaches `add_request` as a ValueError."""
    json: str | dict | None = None          # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None              # llguidance's Lark-like syntax
    json_object: bool | None = None         # any JSON object

    def __post_init__(self):
        self._validate()

    def _validate(self):
        set_fields = [f.name for f in dataclasses.fields(self)
                      if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("StructuredOutputsParams: exactly one of json, regex, choice, "
                             f"grammar, json_object must be set (got {set_fields or 'none'})")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("StructuredOutputsParams.json must be a dict or a JSON string")
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{field} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of "
                             "non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("StructuredOutputsParams.json_object must be a bool")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Prefix caching: only requests with the same salt share cached blocks (tenant isolation:
    # a cache hit's speed would otherwise reveal another tenant's prompt).
    cache_salt: str | None = None
    # Speculative decoding (when the engine has it): False keeps this request to one token a
    # step. The tokens are the same either way.
    speculate: bool = True
    # A grammar the output must follow (jaxbatch/structured/).
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias); the engine
    # checks the ids against its vocabulary.
    logit_bias: dict[int, float] | None = None
    # With the engine's reasoning parser: the thought goes to CompletionOutput.reasoning and
    # `text` is the answer; False keeps the raw text (as /v1/completions returns it).
    split_reasoning: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self):
        def fail(field, why):
            raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")
        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(field, "must be a finite number")
        if self.temperature < 0:
            fail("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2 ** 31:
            fail("top_k", "must be 0 or -1 (off) or a positive integer below 2**31")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(field, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            fail("cache_salt", "must be None or a non-empty string")
        for field in ("speculate", "split_reasoning"):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be a bool")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None")
        self._validate_logit_bias()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "must be a StructuredOutputsParams or None")
            self.structured_outputs._validate()
            # Both fight the grammar over EOS: held back where it is the only allowed token,
            # or sampled past the grammar's end.
            if self.min_tokens:
                fail("min_tokens", "must be 0 with structured_outputs (the grammar decides "
                                   "where the output may end)")
            if self.ignore_eos:
                fail("ignore_eos", "must be False with structured_outputs (the grammar decides "
                                   "where the output may end)")

    def check_token_ids(self, vocab_size: int) -> None:
        """The ids these params name are in the model's vocabulary (the engine knows it)."""
        bad_stop = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop_token_ids {bad_stop} are outside the vocabulary")
        bad_bias = [t for t in self.logit_bias or () if t >= vocab_size]
        if bad_bias:
            raise ValueError(f"SamplingParams.logit_bias: token ids {bad_bias[:5]} are outside "
                             f"the vocabulary [0, {vocab_size})")

    def _validate_logit_bias(self):
        def fail(field, why):     # the dict itself may be long: named, not repeated
            raise ValueError(f"SamplingParams.{field}: {why}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            fail("logit_bias", "must be a dict {token id: bias} or None")
        if len(bias) > MAX_LOGIT_BIAS:
            fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries (got {len(bias)})")
        lo, hi = LOGIT_BIAS_RANGE
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                fail("logit_bias", f"token id {token!r} must be a non-negative integer")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not lo <= value <= hi):
                fail("logit_bias", f"bias {value!r} of token {token} must be a number in "
                                   f"[{lo:g}, {hi:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
