"""The lab: instruments outside the wheel (as vLLM's top-level benchmarks/), run from a checkout.

    python -m benchmarks                 # lists them
    python -m benchmarks NAME [ARGS]     # or: python -m benchmarks.MODULE [ARGS]

Diagnostics (where a step's time goes), peer drivers (vLLM, HF transformers) and the GPU
harness (scripts/gpu_check.sh runs gpu-e2e). They build on the package's benchmark library
(jaxbatch.benchmarks: workloads, harness, report, machine) and see the engine only through its
public observation points (observer.py); nothing in the package imports from here.
"""

# name: (module in benchmarks, one line for the list)
INSTRUMENTS = {
    # peers and the GPU harness
    "vs-vllm": ("vs_vllm", "jaxbatch vs vLLM's CPU build, offline LLM.generate, interleaved"),
    "serve-launch": ("serve_launch", "jaxbatch bench serve with servers started here (jaxbatch, "
                     "vLLM) and served against offline, interleaved"),
    "vllm-offline": ("vllm_offline", "vLLM's side of vs-vllm (run with vLLM's venv python)"),
    "hf-offline": ("hf_offline", "HF transformers' side of vs-vllm"),
    "throughput-hf": ("hf_baselines", "jaxbatch bench throughput + HF generate / generate_batch"),
    "throughput-gpu": ("throughput_gpu", "throughput on a GPU: random 1B/8B shapes, MBU"),
    "gpu-e2e": ("gpu_e2e", "the GPU end-to-end harness (scripts/gpu_check.sh runs it)"),
    "random-checkpoint": ("random_checkpoint", "a random-weight HF checkpoint of a real shape "
                          "(TinyLlama-1.1B, Llama 1B/8B) with the embedded tokenizer"),
    "scaleout": ("scaleout", "tensor / data parallel throughput against one engine"),
    "ray-replicas": ("ray_replicas", "jaxbatch ray-serve: one replica against two, prefix "
                     "affinity against Ray's router (a local Ray cluster)"),
    # diagnostics
    "overlap": ("overlap", "host/device overlap (async scheduling) on vs off"),
    "profile": ("profile", "device time per executable on the mixed chat workload"),
    "ops": ("ops", "one decode step and one prefill chunk op by op (XLA's profiler)"),
    "calls": ("calls", "our CPU kernels' calls in decode steps (instrumented kernel build)"),
    "gemm": ("gemm", "our CPU GEMM kernel over packed weights against XLA's dot"),
    "attention-read": ("attention_read", "decode attention alone against the read bandwidth"),
    "step-keys": ("step_keys", "step time of chosen executable keys (pricing a bucket change)"),
    "dtype": ("dtype", "bf16 vs float32 on this CPU: per-executable profile, a small mix"),
    "detok": ("detok", "host cost of detokenization and stop strings per token"),
    "structured-mask-cost": ("structured_mask_cost", "host cost of grammar masks per step"),
    "families": ("families", "what a family's own layers cost: random Llama, Qwen3, Gemma 3"),
    "lora-delta": ("lora_delta", "the LoRA batch delta's one-hot and gathered forms"),
    "quant-step": ("quant_step", "one decode step, float32 against int8 weights, no engine"),
    "accuracy": ("accuracy", "what int8 costs in accuracy: top-1, KL, perplexity"),
    "accuracy-bf16": ("accuracy_bf16", "bf16 against float32: top-1, KL, perplexity ratio"),
    "hostile": ("hostile", "hostile clients against a server (a robustness tool)"),
}


def emit_json(result: dict, out=None) -> None:
    """A worker's result (a peer's side, in its own venv): printed, and written to `out` when
    given (its parent reads it)."""
    import json
    from pathlib import Path
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text)
    print(text)
