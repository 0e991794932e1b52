"""`jaxbatch serve [MODEL] ...` (also `python -m jaxbatch serve ...`): the OpenAI-compatible server.

Flags are LLM's keyword arguments spelled with dashes, as `vllm serve` spells them. Startup
order matters: uvicorn binds the port first and the engine (weights, warm-up) is built on the
engine thread afterwards, so orchestrators see a live port whose /health says 503 until ready.
Nothing here imports JAX; the engine thread does, when it builds the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import uvicorn

# The embedded model's name (jaxbatch.model.loader.DEFAULT_MODEL; not imported: that pulls JAX).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxbatch")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("model", nargs="?", default=None,
                   help="HF directory or .gguf file; omitted: the embedded SmolLM2-135M-Instruct")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the name /v1/models lists and requests use (default: MODEL as given)")
    s.add_argument("--max-num-seqs", type=int, default=32)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--scheduling-policy", default="fcfs",
                   choices=["fcfs", "priority", "shortest_prompt_first"])
    s.add_argument("--batching", default="continuous", choices=["continuous", "static"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--prefill-chunk-size", type=int, default=None)
    s.add_argument("--attention-backend", default="auto")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV of prompt prefixes already computed (on by default)")
    s.add_argument("--prefix-cache-granularity", default="chunk", choices=["chunk", "block"],
                   help="chunk: prefix hits in whole prefill chunks, outputs exactly as with "
                        "the cache off; block: in whole blocks, as vLLM (short system prompts "
                        "shared too)")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan each step while the previous one runs on the device (on by "
                        "default; outputs are the same without it)")
    s.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, as JSON: \'{"method": "ngram", '
                        '"num_speculative_tokens": 3}\' or \'{"method": "draft_model", '
                        '"model": PATH, "draft_sampling": "sampled"}\' (off by default)')
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="int8: KV cache as int8 with a float32 scale per token and KV head "
                        "(~1.9x the tokens of bfloat16 in the same memory)")
    s.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: weight-only int8 layer matrices, one scale per output channel")
    s.add_argument("--no-warmup", action="store_true",
                   help="ready without compiling every shape first (the first requests compile)")
    s.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 + Retry-After once this many requests are waiting or running")
    s.add_argument("--api-key", default=os.environ.get("JAXBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (env JAXBATCH_API_KEY)")
    s.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before abort")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many devices (every process's, with "
                        "--num-processes)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="independent engine replicas; each request goes to the replica with "
                        "the least outstanding work")
    s.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) joined by jax.distributed into one engine; process "
                        "0 serves HTTP, the others follow its steps")
    s.add_argument("--process-id", type=int, default=0)
    s.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0's jax.distributed coordinator")
    s.add_argument("--log-level", default="info")
    # Tool calls parsed from free text (tool_choice "auto"): entrypoints/openai/tool_parsers.py
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls out of the text (needs --tool-call-parser)')
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"])
    return ap


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args) -> dict:
    return dict(max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                scheduling_policy=args.scheduling_policy, batching=args.batching, seed=args.seed,
                prefill_chunk_size=args.prefill_chunk_size,
                attention_backend=args.attention_backend, warmup=not args.no_warmup,
                enable_prefix_caching=args.enable_prefix_caching,
                prefix_cache_granularity=args.prefix_cache_granularity,
                async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size, num_processes=args.num_processes,
                process_id=args.process_id, coordinator_address=args.coordinator_address,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


def serve(args) -> int:
    from jaxbatch.entrypoints.openai.app import build_app

    model, kwargs = args.model, engine_kwargs(args)
    if args.num_processes > 1:
        # Here, on the main thread, before uvicorn installs its signal handlers (multihost.py).
        from jaxbatch.parallel import multihost
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if args.process_id != 0:
            return follow(model, kwargs)

    def engine_factory():   # runs on the engine thread, after the port is bound
        from jaxbatch.engine.llm_engine import LLMEngine
        engine = LLMEngine(model, **kwargs)
        structured = getattr(engine, "structured", None)   # (replicas' engines have their own)
        if structured is not None:
            structured.prepare_in_background()              # structured outputs' tokenizer
        return engine

    failed = []

    def on_engine_dead(exc):
        # A model that cannot load (or an engine that crashed while starting) ends the process
        # with an error, rather than leaving a port that says 503 forever.
        if not server.started or app.state.llm.engine is None:
            failed.append(exc)
            server.should_exit = True

    name = args.served_model_name or model or DEFAULT_MODEL_NAME
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("jaxbatch serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    app = build_app(engine_factory, served_model_name=name, model_root=model or DEFAULT_MODEL_NAME,
                    api_key=args.api_key, max_queued_requests=args.max_num_queued_reqs,
                    on_engine_dead=on_engine_dead,
                    tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(config, app.state.llm, args.shutdown_timeout)
    server.run()
    engine = app.state.llm.engine
    if hasattr(engine, "shutdown"):     # a multi-process engine: release the followers
        engine.shutdown()
    if failed:
        print(f"jaxbatch serve: the engine failed to start: {failed[0]!r}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def follow(model, kwargs) -> int:
    """A process other than 0 of a multi-process engine: no HTTP; it builds the same engine
    and steps with process 0 until process 0 shuts down."""
    from jaxbatch.engine.llm_engine import LLMEngine
    engine = LLMEngine(model, **kwargs)
    while engine.follow():
        pass
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains instead of closing the port: /health and new
    requests get 503, in-flight requests finish for up to `shutdown_timeout` seconds, the rest
    are aborted; then uvicorn's usual shutdown, and the process exits 0. A second signal (or
    SIGINT) falls back to uvicorn's immediate shutdown."""

    def __init__(self, config, llm, shutdown_timeout: float):
        super().__init__(config)
        self.llm, self.shutdown_timeout = llm, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if sig == signal.SIGTERM and not self._draining and self._loop is not None:
            # We are in a signal handler (main thread, between two bytecodes): only schedule.
            # Not recorded in uvicorn's captured signals, so it is not re-raised at exit: exit 0.
            self._draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self):
        async def drain():
            await self.llm.drain(self.shutdown_timeout)
            self.should_exit = True
        self._drain_task = asyncio.ensure_future(drain())


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
