"""The wire format: OpenAI's request and response bodies (plus vLLM's extras), as pydantic models.

Requests are validated by FastAPI against these models before a handler runs; a body that does
not fit (malformed JSON, a missing field, a wrong type) becomes a 400 with the OpenAI error body
(see app.py). Types are strict: "5" or true where a number is meant, "yes" for a bool, are
refused rather than coerced. Every field is honoured or refused: a field this server does not
implement is a 400 naming it (`check_fields`), never silently dropped; only OpenAI's metadata
fields are accepted without effect. Value checks that the engine already owns (temperature >= 0,
top_p in (0, 1], ...) stay in SamplingParams, so the offline API and the server reject the same
things with the same messages.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_serializer

from jaxbatch.sampling_params import SamplingParams


from jaxbatch.entrypoints.openai.protocol_base import (  # noqa: F401 - shared, named as P.*
    MAX_STOP_CHARS, MAX_STOP_STRINGS, METADATA_FIELDS, REFUSED_FIELDS, SEED_RANGE, ErrorInfo,
    ErrorResponse, _drop_none, _Model, _Request, check_fields)


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool | None = False

class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    # OpenAI's own cap: one request must not hold the whole engine for minutes.
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None      # prefix caching: only equal salts share cached blocks
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens
    # Structured outputs (entrypoints/openai/structured.py reads these; guided_* answer 400
    # naming their replacement).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    return_tokens_as_token_ids: bool = False    # logprob tokens as "token_id:N"
    include_stop_str_in_output: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a field we accept syntactically but cannot honour, or a bound
        checked here because it guards work done before SamplingParams exists."""
        bad = check_fields(self)
        if bad:
            return bad
        if self.stream_options is not None:
            bad = check_fields(self.stream_options)
            if bad:
                return "stream_options", bad[1]
        if any(not (k.isascii() and k.isdigit()) for k in self.logit_bias or ()):
            return "logit_bias", "logit_bias keys must be token ids (integers, as strings)"
        lo, hi = SEED_RANGE
        if self.seed is not None and not lo <= self.seed < hi:
            return "seed", (f"seed must be in [0, 2**32): the engine honours 32-bit seeds, so "
                            f"{self.seed} would not be honoured as given")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            return "stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})"
        if sum(len(x) for x in stops) > MAX_STOP_CHARS:
            return "stop", f"stop strings may total at most {MAX_STOP_CHARS} characters"
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            return "truncate_prompt_tokens", "truncate_prompt_tokens must be an integer >= 1"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs is only returned without stream=true"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError ("SamplingParams.<field>=...: why") for invalid values."""
        pick = lambda v, default: default if v is None else v   # noqa: E731
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0), logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            logit_bias=self.logit_bias and {int(k): v for k, v in self.logit_bias.items()})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self):
        if self.echo and self.stream:
            return "echo", "echo is only returned without stream=true"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (it must equal n)"
        return super().unsupported()


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                    # a "tool" message's answer to one
    # An assistant's earlier thought (vLLM takes either name); templates read reasoning_content.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None   # vLLM's; refused unless --trust-request-chat-template
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None    # (structured.py)
    parallel_tool_calls: bool | None = None

    def unsupported(self):
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        for m in self.messages:
            if m.role == "function":
                return "messages", "role 'function' is OpenAI's deprecated form of 'tool'"
            if (m.reasoning_content is not None or m.reasoning is not None) \
                    and m.role != "assistant":
                return "messages", "only assistant messages carry reasoning"
            for name in (m.model_extra or {}):
                return "messages", f"message field '{name}' is not supported by this server"
            if isinstance(m.content, list):
                if any(p.type != "text" for p in m.content):
                    return "messages", "only text content parts are supported"
                for part in m.content:
                    for name in (part.model_extra or {}):
                        return "messages", f"content part field '{name}' is not supported"
        if self.continue_final_message:
            if self.add_generation_prompt:
                return "continue_final_message", ("continue_final_message needs "
                                                  "add_generation_prompt=false")
            if self.messages[-1].role != "assistant":
                return "continue_final_message", ("continue_final_message needs an assistant "
                                                  "message last")
        return super().unsupported()

    @property
    def template(self) -> str | None:
        """A request-supplied chat template, in either place vLLM accepts one."""
        return self.chat_template or (self.chat_template_kwargs or {}).get("chat_template")

    def template_kwargs(self) -> dict:
        kw = dict(self.chat_template_kwargs or {})
        kw.pop("chat_template", None)
        return kw

    def content_chars(self) -> int:
        return sum((len(m.content) if isinstance(m.content, str)
                    else sum(len(p.text or "") for p in m.content or ()))
                   + len(m.reasoning_content or m.reasoning or "") for m in self.messages)

    def conversation(self) -> list[dict]:
        """Messages as the chat template wants them: content flattened to a string."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text or "" for p in content)
            msg = {"role": m.role, "content": content or ""}
            if m.tool_calls is not None:      # templates render earlier calls and answers
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if thought is not None:
                msg["reasoning_content"] = thought
            out.append(msg)
        return out


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------
class PromptTokensDetails(_Model):
    cached_tokens: int = 0             # prompt tokens served from the prefix cache


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogProbs(_Model):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler, self, ("prompt_logprobs",))


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler, self, ("usage",))


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProb(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(_Model):
    content: list[ChatLogProb] | None = None


class ChatMessageOut(_Model):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None      # with --reasoning-parser: the thought before the content
    tool_calls: list[dict[str, Any]] | None = None    # [{"id", "type", "function": {"name", "arguments"}}]

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler, self, ("reasoning", "tool_calls"))


class ChatChoice(_Model):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None   # vLLM's place

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler, self, ("prompt_logprobs",))


class DeltaMessage(_Model):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # [{"index", "id"?, "type"?, "function": {...}}]

    @model_serializer(mode="wrap")
    def _ser(self, handler):   # OpenAI's deltas carry only the keys that changed
        return _drop_none(handler, self, ("role", "content", "reasoning", "tool_calls"))


class ChatStreamChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler, self, ("usage",))


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxbatch"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]
