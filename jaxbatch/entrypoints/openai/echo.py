"""/v1/completions with `echo: true`: each choice's text starts with its prompt, and its
`logprobs` cover the prompt's tokens before the generated ones, shaped as OpenAI and vLLM
shape them (what lm-evaluation-harness's `local-completions` reads for log-likelihoods):

    tokens          every prompt token's string, then the generated tokens'
    token_logprobs  null for the first prompt token (nothing precedes it), then each token's
                    logprob given the tokens before it
    top_logprobs    null for the first, then the top `logprobs` tokens plus the token itself
    text_offset     running sum of the token strings' lengths, from 0, across both parts

The prompt's logprobs are the engine's `prompt_logprobs`, computed by the prefill the request
runs anyway (the request asks for them, protocol.CompletionRequest.sampling_params).
"""
from __future__ import annotations

from typing import Callable

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0   # JSON has no -inf; vLLM clamps the same way


def prompt_only(req: P.CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt (and its logprobs) and nothing generated."""
    return req.echo and req.max_tokens == 0


def max_tokens(req: P.CompletionRequest) -> int | None:
    """A prompt-only request still samples one token (the prefill's last logits give it for
    free); the response leaves it out."""
    return 1 if prompt_only(req) else req.max_tokens


def ask_prompt_logprobs(req: P.CompletionRequest, params: SamplingParams) -> SamplingParams:
    """With echo and logprobs, the prompt's logprobs from the prefill the request runs anyway."""
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
    return params


async def prompt_texts(req: P.CompletionRequest, prompts: list[list[int]],
                       detokenize: Callable) -> list[str]:
    """The text each choice echoes: a string prompt as sent, token ids (or a truncated prompt)
    as the tokenizer spells them (`detokenize`: off the event loop)."""
    given = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    texts = []
    for sent, ids in zip(given, prompts):
        if isinstance(sent, str) and req.truncate_prompt_tokens is None:
            texts.append(sent)
        else:
            texts.append(await detokenize(ids))
    return texts


def prompt_logprobs(ids: list[int], logprobs: list[dict[int, float] | None] | None, k: int,
                    token_str: Callable[[int], str]) -> P.CompletionLogProbs:
    """The prompt's part of an echoed choice's logprobs (offsets from 0). `logprobs`: the
    engine's prompt_logprobs, whose top entries may be more than `k` (a request asking for
    `prompt_logprobs` too): each position keeps its top `k` and its own token."""
    if logprobs is None or len(logprobs) != len(ids):
        raise RuntimeError("the engine returned no prompt logprobs for an echoed request")
    out, offset = P.CompletionLogProbs(), 0
    for position, (token, lps) in enumerate(zip(ids, logprobs)):
        s = token_str(token)
        if lps is None and position > 0:
            raise RuntimeError(f"prompt position {position} has no logprobs")
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lps is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:k] + [(token, lps[token])]
        out.token_logprobs.append(max(lps[token], MIN_LOGPROB))
        out.top_logprobs.append({token_str(t): max(v, MIN_LOGPROB) for t, v in top})
    return out


def end_offset(part: P.CompletionLogProbs) -> int:
    """Where the text after `part` starts, in the running offsets."""
    if not part.tokens:
        return 0
    return part.text_offset[-1] + len(part.tokens[-1])


def joined(prompt_part: P.CompletionLogProbs,
           generated: P.CompletionLogProbs | None) -> P.CompletionLogProbs:
    if generated is None:
        return prompt_part
    return P.CompletionLogProbs(
        tokens=prompt_part.tokens + generated.tokens,
        token_logprobs=prompt_part.token_logprobs + generated.token_logprobs,
        top_logprobs=prompt_part.top_logprobs + generated.top_logprobs,
        text_offset=prompt_part.text_offset + generated.text_offset)
