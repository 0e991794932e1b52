"""Hugging Face transformers on the same requests, the peers of the throughput benchmark:
`generate` (static batching as users write it: padded groups) and `generate_batch` (its
continuous batching). A token's time is when HF `generate` finishes the step that produced it
(a StoppingCriteria records every step), or HF continuous batching's own per-token timestamps.

    python -m benchmarks throughput-hf [every flag of jaxbatch bench throughput] [--threads N]
"""
from __future__ import annotations

import dataclasses
import os
import time

from tqdm.auto import tqdm

from jaxbatch.benchmarks.harness import RunResult, Trace
from jaxbatch.benchmarks.throughput import Throughput

# The ratio continuous batching is to reach against each (the seed issue's targets).
GOALS = {"hf_generate": 3.0, "hf_generate_batch": 1.5}

def load_hf_model(threads):
    import torch
    from transformers import AutoModelForCausalLM
    from jaxbatch.model.loader import embedded_gguf_path
    torch.set_num_threads(threads)
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def _pad_id(model) -> int:
    cfg = model.generation_config
    for value in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if value is not None:
            return value[0] if isinstance(value, (list, tuple)) else int(value)


def run_hf_generate(model, requests, slots, label="hf_generate", progress=True) -> RunResult:
    """Static batching as users write it: groups of `slots` in order, left-padded, greedy, each
    group runs to the longest output in it (min_new_tokens = max_new_tokens so EOS cannot end
    it early). Only each request's own requested tokens are counted. Offline only."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):         # called once per generated step
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    pad = _pad_id(model)
    traces = []
    bar = tqdm(total=len(requests), desc=label, disable=not progress, leave=False)
    start = time.perf_counter()
    for g in range(0, len(requests), slots):
        group = requests[g:g + slots]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in group])
        new = max(r.output_len for r in group)
        clock = StepClock()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=pad,
                           stopping_criteria=StoppingCriteriaList([clock]))
        for r in group:
            traces.append(Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, start,
                                clock.times[:r.output_len]))
        bar.update(len(group))
    bar.close()
    return RunResult(label, start, traces, info={"group_size": slots})


def run_hf_generate_batch(model, requests, slots, label="hf_generate_batch",
                          progress=True) -> RunResult:
    """HF continuous batching through the manager `generate_batch` wraps: generate_batch takes
    one max_new_tokens for all requests, its manager's add_request takes one per request, so
    both engines run the same lengths. EOS is disabled (eos_token_id=-1); greedy; at most
    `slots` requests per batch, as jaxbatch's max_num_seqs."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                           eos_token_id=-1, pad_token_id=_pad_id(model))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in requests),
                          max_generated_length=max(r.output_len for r in requests),
                          num_requests=len(requests))
    cb = ContinuousBatchingConfig(max_requests_per_batch=slots)
    traces = {}
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=30,
            workload_hints=hints) as manager:
        bar = tqdm(total=len(requests), desc=label, disable=not progress, leave=False)
        start = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt_ids, request_id=r.rid, max_new_tokens=r.output_len,
                                eos_token_id=-1, record_timestamps=True)
            traces[r.rid] = Trace(r.rid, r.kind, len(r.prompt_ids), r.output_len, start)
        finished = 0
        while finished < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"HF continuous batching: {result.error}")
                traces[result.request_id].token_times = list(result.timestamps)
                finished += 1
                bar.update(1)
        bar.close()
    return RunResult(label, start, list(traces.values()), info={"max_requests_per_batch": slots})


def warm_hf(model, requests, slots, engines):
    """A short untimed run of each selected HF path: first-call allocations, thread pools."""
    shortest = sorted(requests, key=lambda r: len(r.prompt_ids))[:4]
    few = [dataclasses.replace(r, output_len=4) for r in shortest]
    if "hf_generate" in engines:
        run_hf_generate(model, few, slots, progress=False)
    if "hf_generate_batch" in engines:
        run_hf_generate_batch(model, few, slots, progress=False)


def setup(args, requests) -> dict:
    """The HF model loaded and warmed; {engine name: run(requests, slots)} for throughput."""
    model = load_hf_model(args.threads)
    warm_hf(model, requests, args.max_num_seqs, args.engines)
    return {"hf_generate": lambda reqs, slots: run_hf_generate(model, reqs, slots),
            "hf_generate_batch": lambda reqs, slots: run_hf_generate_batch(model, reqs, slots)}


class ThroughputHF(Throughput):
    name, prog, workloads = "throughput-hf", "python -m benchmarks throughput-hf", ("offline",)
    peer_goals = GOALS

    def peer_runs(self, args, requests) -> dict:
        return setup(args, requests)

    def add_arguments(self, ap) -> None:
        super().add_arguments(ap)
        ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")


main = ThroughputHF().main


if __name__ == "__main__":
    main()
