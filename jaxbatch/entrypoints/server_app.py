"""One server, from its flags: the flags (`add_server_flags`) and the FastAPI app they make
(`server_app`). `jaxbatch serve` runs that app under uvicorn (cli.py); every `jaxbatch
ray-serve` replica runs it inside its Ray actor (ray_cluster/replica.py). Nothing here imports
JAX; the engine thread does, when it builds the engine."""
from __future__ import annotations

import argparse
import gc
import os
import sys

from jaxbatch.engine.config import add_engine_flags, engine_kwargs_from_args, int_at_least

# The embedded model's name (jaxbatch.model.loader.DEFAULT_MODEL; not imported: that pulls JAX).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_positive = int_at_least(1)


def server_parser() -> argparse.ArgumentParser:
    """The flags of one server, without those of its HTTP listener (host, port, timeouts)."""
    p = argparse.ArgumentParser(prog="jaxbatch serve")
    add_server_flags(p)
    return p


def add_server_flags(s: argparse.ArgumentParser) -> None:
    """What one server (one engine and its HTTP front) is: `serve` and every `ray-serve`
    replica take the same flags."""
    add_engine_flags(s)      # every engine option, from jaxbatch/engine/config.py
    s.add_argument("--served-model-name", default=None,
                   help="the name /v1/models lists and requests use (default: MODEL as given)")
    s.add_argument("--max-num-queued-reqs", type=_positive, default=None,
                   help="answer 503 + Retry-After once this many sequences (prompts x n) are "
                        "waiting or running")
    s.add_argument("--max-prompts-per-request", type=_positive, default=128,
                   help="prompts one /v1/completions request may list")
    s.add_argument("--max-request-body-bytes", type=_positive, default=4 << 20,
                   help="413 for a larger request body, checked while it is read")
    s.add_argument("--max-concurrent-requests", type=_positive, default=None,
                   help="503 beyond this many requests in flight (/health, /metrics exempt)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="allow chat_template in requests (rendered in a killable subprocess "
                        "with time, size and memory limits); refused with 400 otherwise")
    s.add_argument("--api-key", default=os.environ.get("JAXBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (env JAXBATCH_API_KEY)")
    # Tool calls parsed from free text (tool_choice "auto"): entrypoints/openai/tool_parsers.py
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls out of the text (needs --tool-call-parser)')
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"])
    # LoRA adapters a request may name in "model" (entrypoints/openai/lora_routes.py)
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapters served under NAME (needs --enable-lora)")


def server_app(args, on_engine_dead=None):
    """The FastAPI app of one server from its flags (`add_server_flags`): what `serve` runs
    under uvicorn and what each `ray-serve` replica runs in its actor. None (said on stderr)
    for flags that contradict each other; ValueError for a bad option."""
    from jaxbatch.entrypoints.openai.app import build_app
    from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry, parse_lora_modules

    kwargs = engine_kwargs_from_args(args)
    model = kwargs.pop("model")
    name = args.served_model_name or model or DEFAULT_MODEL_NAME
    lora = LoRARegistry(name, kwargs.get("enable_lora", False),
                        parse_lora_modules(args.lora_modules))    # ValueError: exit 2

    def engine_factory():   # runs on the engine thread, after the port is bound
        from jaxbatch.engine.build import build_engine
        engine = build_engine(model, **kwargs)
        lora.check_at_start(engine)    # a bad adapter: the server refuses to start, saying why
        engine.prepare_for_serving()        # e.g. the grammar tokenizer, off the engine thread
        _freeze_startup_heap()
        return engine

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("jaxbatch serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return None
    return build_app(engine_factory, served_model_name=name,
                     model_root=model or DEFAULT_MODEL_NAME,
                     api_key=args.api_key, max_queued_requests=args.max_num_queued_reqs,
                     on_engine_dead=on_engine_dead,
                     trust_request_chat_template=args.trust_request_chat_template,
                     max_prompts_per_request=args.max_prompts_per_request,
                     max_request_body_bytes=args.max_request_body_bytes,
                     max_concurrent_requests=args.max_concurrent_requests,
                     tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                     lora=lora)


def _freeze_startup_heap() -> None:
    """Everything alive once the engine is built (the weights' wrappers, compiled executables,
    tokenizer tables: hundreds of thousands of objects) moves out of Python's cyclic collector.
    A full collection walks every tracked object while it holds the GIL: on a serving process
    it paused every stream at once, now and then (docs/BENCHMARKS.md). vLLM freezes its engine's
    start-up heap for the same reason. What the server allocates from here on is collected as
    before; this process keeps one engine for its life, so nothing frozen is waiting to be freed."""
    gc.collect()
    gc.freeze()
