"""The throughput benchmark on a GPU: random-weight Llama shapes in bf16, token-id prompts,
continuous vs static, and the model-bandwidth utilisation of each decode step: (weights read +
KV read) / step time / copy bandwidth measured in the same run.

    python -m benchmarks throughput-gpu [--gpu-models 1B 8B] [--dry-run] [throughput's flags]
"""
from __future__ import annotations

import gc

import numpy as np

from benchmarks import gpu_e2e as random_models
from jaxbatch.benchmarks.harness import (enable_xla_cache, ideal_ratio, pow2_model_len,
                                         run_jaxbatch, step_stats, summarize, warmed_engine)
from jaxbatch.benchmarks.throughput import Throughput, engine_table
from benchmarks.observer import KvReadMeter, observe
from jaxbatch.benchmarks.report import fmt, table
from jaxbatch.benchmarks.workloads import load_prompts, offline_requests

# Token-id prompts (no tokenizer) get ~ len(text) / 4 tokens plus what a chat template adds.
CHARS_PER_TOKEN, CHAT_TEMPLATE_TOKENS = 4, 30


def synthetic_prompt_ids(entries, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids with the bundled prompts' approximate lengths (models without tokenizer)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, len(e["text"]) // CHARS_PER_TOKEN
                         + CHAT_TEMPLATE_TOKENS).tolist() for e in entries]


def bandwidth_utilisation(run, meter_steps, weight_bytes, kv_token_bytes, copy_bps) -> dict:
    """MBU per decode-only step = (weights read + KV read) / step time / copy bandwidth.
    Step time is the wall time of `engine.step()` (host work included)."""
    per_step = meter_steps[-len(run.step_seconds):]
    decode = [(kv, dt) for (kv, decode_only), dt in zip(per_step, run.step_seconds) if decode_only]
    moved = [weight_bytes + kv * kv_token_bytes for kv, _ in decode]
    seconds = [dt for _, dt in decode]
    return {"decode_steps": len(decode),
            "mbu_median": float(np.median(np.divide(moved, seconds))) / copy_bps if decode else None,
            "mbu_aggregate": sum(moved) / sum(seconds) / copy_bps if decode else None,
            "decode_step_ms_median": 1e3 * float(np.median(seconds)) if decode else None}


def bench_gpu(args, entries) -> dict:
    """Random-weight Llama shapes (bf16), token-id prompts, continuous vs static, MBU."""
    import jax
    from jaxbatch.worker.kv_cache import bytes_per_block
    from jaxbatch.model.quantize import quantize_params
    models = args.gpu_models or (["tiny"] if args.dry_run else ["1B", "8B"])
    copy_bytes = (8 << 20) if args.dry_run else (1 << 30)
    copy_bps = random_models.copy_bandwidth(copy_bytes)
    out = {"copy_GBps": copy_bps / 1e9, "device": str(jax.devices()[0].device_kind), "models": {}}
    for name in models:
        loaded = random_models.random_model(name, "bfloat16", args.seed)
        if args.quantization:               # quantized here so the MBU counts int8 bytes
            loaded.params = quantize_params(loaded.params)
        cfg = loaded.config
        prompts = synthetic_prompt_ids(entries, cfg.vocab_size, args.seed)
        requests = offline_requests(prompts, [e["kind"] for e in entries], args.num_requests,
                                    args.lengths, args.seed, args.max_prompt_len)
        weight_bytes = random_models.param_bytes(loaded.params)
        if not cfg.tie_word_embeddings:     # an untied embedding table is only gathered
            weight_bytes -= loaded.params["embed"].nbytes
        kv_token_bytes = bytes_per_block(cfg, 1, loaded.params["embed"].dtype, args.kv_cache_dtype)
        model_len = pow2_model_len(requests)
        result = {"weight_bytes_read_per_step": weight_bytes, "max_model_len": model_len,
                  "ideal": ideal_ratio([r.output_len for r in requests], args.max_num_seqs),
                  "summaries": {}}
        first = None
        for batching in ("continuous", "static"):
            engine = warmed_engine(loaded, batching, args.max_num_seqs, model_len, requests,
                                   args.warmup, shared=first,
                                   num_blocks=args.max_num_seqs * (model_len // 16) + 1,
                                   **args.engine_kwargs)
            with observe(engine, KvReadMeter()) as meter:
                run = run_jaxbatch(engine, requests, f"{name} {batching}")
            result["summaries"][batching] = {
                **summarize(run), **step_stats(run, args.max_num_seqs), **run.info,
                **bandwidth_utilisation(run, meter.per_step, weight_bytes, kv_token_bytes,
                                        copy_bps)}
            first = first or engine
        del engine, first
        gc.collect()                        # frees the KV pool before the next model
        out["models"][name] = result
        del loaded
        gc.collect()
    return out


class ThroughputGPU(Throughput):
    name, prog, workloads = "throughput-gpu", "python -m benchmarks throughput-gpu", ("offline",)

    def add_arguments(self, ap) -> None:
        super().add_arguments(ap)
        ap.set_defaults(warmup=None, max_num_seqs=None, num_requests=None)  # resolve's, below
        ap.add_argument("--gpu-models", nargs="+", default=None,
                        help="shapes from gpu_e2e.MODEL_SHAPES (default 1B 8B)")
        ap.add_argument("--dry-run", action="store_true",
                        help="on CPU with a tiny random model and short prompts")

    def load(self, args):
        return None                         # bench_gpu builds its random models one by one

    def resolve(self, args):
        args.warmup = args.warmup or "workload"
        args.max_num_seqs = args.max_num_seqs or (4 if args.dry_run else 64)
        args.num_requests = args.num_requests or (12 if args.dry_run else 4 * args.max_num_seqs)
        args = super().resolve(args)
        if args.dry_run:
            # Tiny everything: checks the GPU path's code on CPU, Pallas in interpret mode.
            args.max_num_seqs, args.num_requests = min(args.max_num_seqs, 4), min(args.num_requests, 12)
            args.max_prompt_len = args.max_prompt_len or 40
            args.lengths = (8, args.output_sigma, 2, 24)
            args.engine_kwargs["attention_backend"] = "pallas_interpret"
        return args

    def bench(self, loaded, args) -> dict:
        args = self.resolve(args)
        return {"xla_cache": enable_xla_cache(args.xla_cache),
                "gpu": bench_gpu(args, load_prompts(args.prompts))}

    def plots(self, report, out_dir):
        return []

    def markdown(self, report) -> str:
        parts, price = [], report["price"]
        for name, m in report["gpu"]["models"].items():
            parts.append(f"\nGPU {name} (bf16 random weights), copy bandwidth "
                         f"{report['gpu']['copy_GBps']:.0f} GB/s, ideal ratio "
                         f"{m['ideal']['ideal_ratio']:.2f}\n")
            parts.append(engine_table(m["summaries"], price) + "\n")
            parts.append(table(["engine", "MBU median", "MBU aggregate", "decode step ms"],
                               [[b, fmt(s["mbu_median"], 2), fmt(s["mbu_aggregate"], 2),
                                 fmt(s["decode_step_ms_median"], 2)]
                                for b, s in m["summaries"].items()]))
        return "\n".join(parts)


main = ThroughputGPU().main


if __name__ == "__main__":
    main()
