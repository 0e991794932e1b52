"""float32 against bf16 on the embedded model, small and short (issue 27; docs/BENCHMARKS.md).

    python -m benchmarks dtype profile --dtype bfloat16     # 4 requests x 8 tokens, 4 slots
    python -m benchmarks dtype mixed [--dtypes float32,bfloat16] [--rounds 2]

profile: every executable is waited for and timed (host/device overlap off), so each call's
wall time is its device time; prints calls, total and median per key.
mixed: 16 chat requests from `bench serve`'s prompts, outputs lognormal(32, 1) in [8, 64]
(EOS ignored), 8 slots, greedy; one engine per dtype, an untimed pass each, then rounds
alternating between the engines; one JSON line per round.
"""
from __future__ import annotations

import argparse
import json
import time



def profile(dtype: str) -> None:
    from benchmarks.observer import ExecutableTimer, observe
    from jaxbatch import LLM, SamplingParams
    llm = LLM(dtype=dtype, max_num_seqs=4, async_scheduling=False)
    prompts = ["Tell me a story about a dragon.", "What is 2+2?", "Write a haiku about the sea.",
               "List three colors."]
    # The runner's executable observers (public): with one attached, each executable is waited
    # for, so its wall time is its device time.
    with observe(llm.llm_engine, ExecutableTimer()) as timer:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        elapsed = time.perf_counter() - start
    print(json.dumps({"dtype": llm.llm_engine.stats()["dtype"], "seconds": round(elapsed, 3)}))
    for key, (calls, seconds) in sorted(timer.per_key.items(), key=lambda kv: -kv[1][1]):
        print(key, calls, f"total {seconds:.3f} s", f"mean {seconds / calls * 1e3:.1f} ms")


def mixed(dtypes: list[str], rounds: int) -> None:
    from jaxbatch.benchmarks.workloads import make_workload
    from jaxbatch import LLM, SamplingParams
    workload = make_workload(16, lengths=(32, 1.0, 8, 64))
    chats = [[{"role": "user", "content": r.text}] for r in workload]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in workload]
    total = sum(r.max_tokens for r in workload)
    llms = {}
    for d in dtypes:
        llms[d] = LLM(dtype=d, max_num_seqs=8, max_model_len=2048)
        llms[d].chat(chats[:8], params[:8], use_tqdm=False)           # untimed
    for r in range(rounds):
        for d in dtypes:
            start = time.perf_counter()
            outs = llms[d].chat(chats, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outs) == total
            stats = llms[d].llm_engine.stats()
            print(json.dumps({"round": r, "dtype": stats["dtype"], "tok_s": round(total / elapsed, 1),
                              "seconds": round(elapsed, 2),
                              "compilations_after_warmup": stats["num_compilations_after_warmup"]}),
                  flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("profile", "mixed"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if args.mode == "profile":
        profile(args.dtype)
    else:
        mixed(args.dtypes.split(","), args.rounds)


if __name__ == "__main__":
    main()
