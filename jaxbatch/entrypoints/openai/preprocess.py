"""From a validated request to prompt token ids, with every bound checked before the work.

On the event loop, before admission (cheap, no tokenizer): a request-supplied chat template
without --trust-request-chat-template, more prompts than --max-prompts-per-request, and a
prompt too long to fit max_model_len whatever it tokenizes to. The character cap is
max_model_len x the longest token's length in characters: a prompt with more characters has
more tokens than max_model_len for certain, so it is refused before the tokenizer sees it.
Then, on a TokenizerPool worker: the model's template (or, trusted, the request's, in the
killable child of template_render.py) and tokenization.
"""
from __future__ import annotations

import asyncio

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.errors import APIError
from jaxbatch.entrypoints.openai.template_render import TemplateError, TemplateRenderer
from jaxbatch.entrypoints.openai.tokenizer_pool import PoolTimeout, TokenizerPool

DEFAULT_MAX_PROMPTS_PER_REQUEST = 128


def count_prompts(prompt) -> int:
    """The number of prompts in a completions `prompt`, without tokenizing anything."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


class Preprocessor:
    def __init__(self, llm, *, trust_request_chat_template: bool = False,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 pool: TokenizerPool | None = None, renderer: TemplateRenderer | None = None):
        self.llm = llm
        self.trust_request_chat_template = trust_request_chat_template
        self.max_prompts_per_request = max_prompts_per_request
        self.pool = pool or TokenizerPool()
        self.renderer = renderer or TemplateRenderer()
        self.max_token_chars = 1
        self._starting: asyncio.Lock | None = None

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_token_chars

    async def start(self) -> None:
        """Once the engine is ready: the pool's tokenizer copies (off the loop: ~0.2 s each)."""
        if self.pool.started:
            return
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self.pool.started:
                return
            tok = self.llm.tokenizer
            if tok is not None:
                self.max_token_chars = max(1, max(len(t) for t in tok.get_vocab()))
            await asyncio.get_running_loop().run_in_executor(None, self.pool.start, tok)

    def close(self) -> None:
        self.pool.shutdown()
        self.renderer.close()

    async def _run(self, fn, *args):
        await self.start()
        try:
            return await self.pool.run(fn, *args)
        except PoolTimeout as e:
            raise APIError(500 if e.started else 503, str(e), None,
                           None if e.started else {"Retry-After": "1"}) from None

    def _too_long(self, chars: int, param: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_model_len} "
                             f"tokens; your prompt has {chars} characters, more than any "
                             f"{self.max_model_len} tokens can spell ({self.max_prompt_chars}).",
                        param)

    # ---- chat ----------------------------------------------------------------------------
    def check_chat(self, req: P.ChatCompletionRequest) -> None:
        if req.template is not None and not self.trust_request_chat_template:
            raise APIError(400, "a chat template in the request is refused: the server runs "
                                "the model's own (start it with --trust-request-chat-template "
                                "to allow request templates)", "chat_template")
        chars = req.content_chars()
        if req.truncate_prompt_tokens is None and chars > self.max_prompt_chars:
            raise self._too_long(chars, "messages")

    async def chat_ids(self, req: P.ChatCompletionRequest) -> list[int]:
        self.check_chat(req)
        return self._truncate(await self._run(self._render_chat, req), req)

    def _render_chat(self, tok, req: P.ChatCompletionRequest) -> list[int]:
        """On a pool worker. The model's template: the same call as LLM.chat, same tokens."""
        if tok is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token "
                                "ids", "messages")
        if req.template is not None:
            return self._render_request_template(tok, req)
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        kwargs = req.template_kwargs()
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        if req.tools:
            kwargs["tools"] = req.tools          # templates that know tools show them
        try:
            p = tok.apply_chat_template(req.conversation(), tokenize=True, return_dict=False,
                                        add_generation_prompt=req.add_generation_prompt,
                                        **kwargs)
        except Exception as e:   # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"chat template failed: {e}", "messages") from None
        return list(p["input_ids"]) if hasattr(p, "keys") else list(p)

    def _render_request_template(self, tok, req) -> list[int]:
        if req.continue_final_message:
            raise APIError(400, "continue_final_message is not supported with a request chat "
                                "template", "continue_final_message")
        context = {**req.template_kwargs(), "messages": req.conversation(), "tools": req.tools,
                   "add_generation_prompt": req.add_generation_prompt,
                   **{k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "pad_token",
                                                        "unk_token")}}
        try:
            text = self.renderer.render(req.template, context, self.max_prompt_chars)
        except TemplateError as e:
            raise APIError(400, f"chat template failed: {e}", "chat_template") from None
        # As apply_chat_template(tokenize=True): the template writes the special tokens itself.
        return list(tok(text, add_special_tokens=False)["input_ids"])

    # ---- completions -----------------------------------------------------------------------
    def check_completion(self, req: P.CompletionRequest) -> int:
        """The number of prompts, after the caps that need no tokenizer."""
        count = count_prompts(req.prompt)
        if count > self.max_prompts_per_request:
            raise APIError(400, f"at most {self.max_prompts_per_request} prompts per request "
                                f"(got {count}; --max-prompts-per-request)", "prompt")
        if req.truncate_prompt_tokens is None:
            texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            for p in texts:
                if isinstance(p, str) and len(p) > self.max_prompt_chars:
                    raise self._too_long(len(p), "prompt")
        return count

    async def completion_ids(self, req: P.CompletionRequest) -> list[list[int]]:
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        if any(isinstance(p, str) for p in prompts):
            prompts = await self._run(self._tokenize_all, prompts)
        return [self._truncate(list(p), req) for p in prompts]

    @staticmethod
    def _tokenize_all(tok, prompts) -> list[list[int]]:
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
        return [p if not isinstance(p, str) else list(tok(p)["input_ids"]) for p in prompts]

    def _truncate(self, ids: list[int], req) -> list[int]:
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens={k} is more than max_model_len="
                                f"{self.max_model_len}", "truncate_prompt_tokens")
        return ids[-k:]     # vLLM keeps the prompt's end: the question, not the preamble

    # ---- /tokenize ------------------------------------------------------------------------------
    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise self._too_long(len(text), "prompt")

        def work(tok):
            if tok is None:
                raise APIError(400, "this model has no tokenizer", "prompt")
            return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        return await self._run(work)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._run(lambda tok: tok.decode(ids))
