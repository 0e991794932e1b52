"""`jaxbatch serve [MODEL] ...` (also `python -m jaxbatch serve ...`): the OpenAI-compatible server.

Flags are LLM's keyword arguments spelled with dashes, as `vllm serve` spells them. Startup
order matters: uvicorn binds the port first and the engine (weights, warm-up) is built on the
engine thread afterwards, so orchestrators see a live port whose /health says 503 until ready.
Nothing here imports JAX; the engine thread does, when it builds the engine. The server's
flags and app: server_app.py; `jaxbatch ray-serve`: ray_cluster/.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvicorn

from jaxbatch.engine.config import EngineConfig, engine_kwargs_from_args, int_at_least
from jaxbatch.entrypoints.server_app import add_server_flags, server_app

SERVING_SWITCH_INTERVAL_S = 0.0005


def _port(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 65535:   # uvicorn would listen on value % 65536 and log the value given
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0..65535)")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxbatch")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--timeout-header-read", type=float, default=10.0,
                   help="close a connection that takes longer to send a request's headers")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="close a keep-alive connection idle this long")
    s.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before abort")
    s.add_argument("--log-level", default="info")
    # --- ray-serve: the same server as replicas on a Ray cluster (entrypoints/ray_cluster/)
    r = sub.add_parser("ray-serve", help="the same server as replicas on a Ray cluster",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_flags(r)
    from jaxbatch.entrypoints.ray_cluster.flags import add_ray_flags
    add_ray_flags(r)
    # --- bench: listed here for `jaxbatch --help`; main() hands its arguments to the registry
    sub.add_parser("bench", help="benchmarks: `jaxbatch bench` lists them", add_help=False)
    return ap


def serve(args) -> int:
    kwargs = engine_kwargs_from_args(args)
    EngineConfig.from_kwargs(**kwargs)     # refuse bad options now, not on the engine thread
    if args.num_processes > 1:
        # Here, on the main thread, before uvicorn installs its signal handlers (multihost.py).
        from jaxbatch.engine import multihost
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if args.process_id != 0:
            return follow(kwargs.pop("model"), kwargs)

    failed = []

    def on_engine_dead(exc):
        # A model that cannot load (or an engine that crashed while starting) ends the process
        # with an error, rather than leaving a port that says 503 forever.
        if not server.started or app.state.llm.engine is None:
            failed.append(exc)
            server.should_exit = True

    app = server_app(args, on_engine_dead)
    if app is None:
        return 2
    _raise_fd_limit()
    # The engine thread and the event loop share the GIL. When the engine thread comes back
    # from the device wanting it while the loop is writing a step's chunks, CPython hands it
    # over only after the switch interval (5 ms by default): the next step's dispatch waits
    # on HTTP work. A short interval bounds that wait.
    sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)
    from jaxbatch.entrypoints.openai.connections import guarded_protocol
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive,
                            http=guarded_protocol(args.timeout_header_read))
    server = DrainingServer(config, app.state.llm, args.shutdown_timeout)
    # uvicorn puts back the handlers it found once it has shut down: a SIGTERM or SIGINT that
    # lands between then and the exit would kill a process that has drained cleanly (exit
    # -15 / 130 instead of 0). The ones it finds ignore it; after it, SIG_IGN itself, as
    # Python resets its own handlers to the default while the interpreter finalizes.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    engine = app.state.llm.engine
    if engine is not None:
        engine.shutdown()         # a multi-process engine: release the followers
    if failed:
        print(f"jaxbatch serve: the engine failed to start: {failed[0]!r}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _raise_fd_limit() -> None:
    """Soft file-descriptor limit up to the hard one: idle sockets must not be what makes
    /health unreachable (the header and keep-alive timeouts then bound how long they stay)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def follow(model, kwargs) -> int:
    """A process other than 0 of a multi-process engine: no HTTP; it builds the same engine
    and steps with process 0 until process 0 shuts down."""
    from jaxbatch.engine.build import build_engine
    engine = build_engine(model, **kwargs)
    while engine.follow():
        pass
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM or SIGINT drains instead of closing the port: /health
    and new requests get 503, in-flight requests finish for up to `shutdown_timeout` seconds,
    the rest are aborted; then uvicorn's usual shutdown, and the process exits 0. A second
    signal cuts the drain short: everything still running is aborted at once, but through the
    engine, so every stream still gets its final chunk and [DONE] (and every other request a
    503), and the exit is still 0. Only a third signal is uvicorn's immediate exit."""

    def __init__(self, config, llm, shutdown_timeout: float):
        super().__init__(config)
        self.llm, self.shutdown_timeout = llm, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if sig in (signal.SIGTERM, signal.SIGINT) and self._loop is not None \
                and self._signals < 2:
            # We are in a signal handler (main thread, between two bytecodes): only schedule.
            # Not recorded in uvicorn's captured signals, so it is not re-raised at exit: exit 0.
            self._signals += 1
            self._loop.call_soon_threadsafe(
                self._start_drain if self._signals == 1 else self.llm.hurry)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self):
        async def drain():
            await self.llm.drain(self.shutdown_timeout)
            self.should_exit = True
        self._drain_task = asyncio.ensure_future(drain())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:   # --- bench: each benchmark parses its own flags
        from jaxbatch.benchmarks.registry import main as bench
        return bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("serve", "ray-serve"):
        try:
            if args.command == "ray-serve":
                from jaxbatch.entrypoints.ray_cluster.deploy import main as ray_serve
                return ray_serve(args)
            return serve(args)
        except ValueError as e:         # a bad option: said in one line, exit 2 like argparse
            print(f"jaxbatch {args.command}: error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
