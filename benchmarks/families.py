"""What a family's own layers cost: random checkpoints of Llama, Qwen3 and Gemma 3 (text) of one
size (~100M parameters by default: hidden 768, 12 layers, GQA 12/4, MLP 2048, the embedded
tokenizer's vocabulary), written by transformers' `save_pretrained` and loaded by
`LLM(model=dir)`, on one workload of token-id prompts, rounds interleaved between the engines.

Qwen3 adds a q/k RMSNorm per head; Gemma 3 adds sandwich norms, the q/k norm, a scaled
embedding, GELU and sliding windows on five layers of six (`--window`, shorter than most
contexts so the window is exercised).

    python -m benchmarks families --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from jaxbatch.benchmarks.base import add_flags
from jaxbatch.benchmarks.machine import machine_info
from jaxbatch.benchmarks.report import table, write_report

FAMILIES = ("llama", "qwen3", "gemma3")


def hf_config(family: str, args):
    import transformers
    base = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=True)
    if family == "llama":
        return transformers.LlamaConfig(**base)
    if family == "qwen3":
        return transformers.Qwen3Config(**base)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**base, sliding_window=args.window,
                                             sliding_window_pattern=6)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def write_checkpoint(family: str, folder: str, args) -> int:
    """save_pretrained of a random model in bf16 -> its parameter count."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, args),
                                                          dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def workload(args) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request: prompts uniform in [32, 256] tokens, outputs
    lognormal around 32 in [8, 128]."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_requests):
        n = int(rng.integers(32, 257))
        length = int(np.clip(round(rng.lognormal(np.log(32), 0.8)), 8, 128))
        out.append((rng.integers(3, args.vocab, n).tolist(), length))
    return out


def run_round(engine, requests, tag: str) -> dict:
    from jaxbatch import SamplingParams
    start = time.perf_counter()
    for i, (ids, n) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=n,
                                                             ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    add_flags(ap, hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=49152,
              window=128, num_requests=32, max_num_seqs=16, dtype="auto", rounds=3, seed=0)
    ap.add_argument("--out", default="bench_out/families")
    args = ap.parse_args(argv)

    from jaxbatch import LLM
    requests = workload(args)
    engines, params = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families:
            folder = os.path.join(tmp, fam)
            params[fam] = write_checkpoint(fam, folder, args)
            llm = LLM(model=folder, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                      max_model_len=512, num_blocks=args.max_num_seqs * 32 + 64,
                      enable_prefix_caching=False, compilation_cache=False)
            engines[fam] = llm.llm_engine
            run_round(engines[fam], requests[:4], f"{fam}-warm")     # first steps, untimed
            print(f"{fam}: {params[fam] / 1e6:.1f}M parameters, "
                  f"dtype {engines[fam].stats()['dtype']}", flush=True)
    rounds = {fam: [] for fam in args.families}
    for r in range(args.rounds):
        for fam in args.families:                     # interleaved: the machine drifts
            res = run_round(engines[fam], requests, f"{fam}-{r}")
            rounds[fam].append(res)
            print(f"round {r} {fam}: {res['output_tok_s']:.1f} out tok/s", flush=True)
    base = statistics.median(x["output_tok_s"] for x in rounds[args.families[0]])
    rows = []
    for fam in args.families:
        tps = [x["output_tok_s"] for x in rounds[fam]]
        st = engines[fam].stats()
        rows.append([fam, f"{params[fam] / 1e6:.1f}M", st["dtype"],
                     " / ".join(f"{t:.1f}" for t in tps), f"{statistics.median(tps):.1f}",
                     f"{statistics.median(tps) / base:.2f}",
                     st["num_compilations_after_warmup"]])
    md = table(["family", "params", "dtype", "out tok/s per round", "median",
                f"vs {args.families[0]}", "compilations after warm-up"], rows)
    print(md)
    report = {"machine": machine_info(), "args": vars(args), "params": params, "rounds": rounds}
    for path in write_report(args.out, "families", report, md):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
