"""What bf16 costs in accuracy, against float32, on the same checkpoint (issue 27).

    python -m benchmarks accuracy-bf16 [--window 512] [--chunk 128] [--max-tokens 32] [--out accuracy_out]

Reuses `bench accuracy`'s harness (accuracy.py): the same bundled text, windows and chunked prefill
through the engine's own forward, with float32 as the reference instead of the full-precision
variant of one dtype:
  teacher-forced   top-1 agreement of bf16's next-token argmax with float32's, mean KL
                   (float32 || bf16), and the perplexity of the text under each (and their ratio)
  greedy           accuracy.py's chat prompts, greedy, `--max-tokens` tokens each (EOS
                   ignored, so every prompt runs its full length), one LLMEngine per dtype:
                   tokens generated before bf16's first token that differs from float32's
Writes accuracy_bf16.json and prints a markdown summary.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import accuracy
from jaxbatch.worker.model_calls import reference_params
from jaxbatch.model.loader import load_model
from jaxbatch.model.rope import inverse_frequencies

DTYPES = ("float32", "bfloat16")


def teacher_forced(params, cfg, ids, window, chunk) -> dict:
    inv_freq = jnp.asarray(inverse_frequencies(cfg))
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w[:len(w) // chunk * chunk] for w in windows if len(w) >= chunk]
    agree, kl, nll = [], [], {d: [] for d in DTYPES}
    for w in windows:
        targets = jnp.asarray(w[1:], jnp.int32)
        lp = {d: accuracy.window_logprobs(params[d], cfg, "auto", jnp.dtype(d), w, chunk,
                                          inv_freq)[:-1] for d in DTYPES}
        a, k, n = accuracy.compare(lp["float32"], lp["bfloat16"], targets)
        agree.append(np.asarray(a)), kl.append(np.asarray(k, np.float64))
        nll["bfloat16"].append(np.asarray(n, np.float64))
        nll["float32"].append(np.asarray(accuracy.compare(lp["float32"], lp["float32"], targets)[2],
                                         np.float64))
    ppl = {d: float(np.exp(np.concatenate(v).mean())) for d, v in nll.items()}
    agree, kl = np.concatenate(agree), np.concatenate(kl)
    return {"windows": len(windows), "positions": int(agree.size),
            "top1_agreement": float(agree.mean()), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "perplexity": ppl,
            "perplexity_ratio": ppl["bfloat16"] / ppl["float32"]}


def greedy(loaded, max_tokens) -> list[dict]:
    from jaxbatch import LLM, SamplingParams
    from jaxbatch.engine.llm_engine import LLMEngine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in accuracy.PROMPTS]
    out = {}
    for d in DTYPES:
        engine = LLMEngine(loaded=loaded[d], max_num_seqs=4, max_model_len=256, warmup=False)
        assert engine.stats()["dtype"] == d
        out[d] = LLM.from_engine(engine).chat(chats, sp, use_tqdm=False)
    rows = []
    for i, prompt in enumerate(accuracy.PROMPTS):
        a, b = (list(out[d][i].outputs[0].token_ids) for d in DTYPES)
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"prompt": prompt, "tokens": len(a), "identical_prefix_tokens": same,
                     **{d: out[d][i].outputs[0].text for d in DTYPES}})
    return rows


def markdown(r) -> str:
    t = r["teacher_forced"]
    lines = [f"bf16 against float32, teacher-forced over {t['positions']} positions "
             f"({t['windows']} windows of <= {r['window']}, prefill chunks of {r['chunk']}):\n",
             "| top-1 agreement | mean KL (nats) | max KL | perplexity f32 | perplexity bf16 | ratio |",
             "|---|---|---|---|---|---|",
             f"| {100 * t['top1_agreement']:.2f} % | {t['mean_kl']:.5f} | {t['max_kl']:.3f} | "
             f"{t['perplexity']['float32']:.3f} | {t['perplexity']['bfloat16']:.3f} | "
             f"{t['perplexity_ratio']:.4f} |"]
    if r.get("greedy"):
        g = r["greedy"]
        same = sum(x["identical_prefix_tokens"] for x in g)
        total = sum(x["tokens"] for x in g)
        lines.append(f"\nGreedy, first {r['max_tokens']} tokens of {len(g)} chat prompts: "
                     f"{same}/{total} tokens before the first divergence "
                     f"({', '.join(str(x['identical_prefix_tokens']) for x in g)} per prompt)")
        for x in g:
            lines.append(f"\n**{x['prompt']}**\n\n- float32: {x['float32']!r}\n"
                         f"- bfloat16: {x['bfloat16']!r}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = accuracy.parse_common(ap, argv, max_tokens=32)
    start = time.perf_counter()
    loaded = {d: load_model(args.model, d) for d in DTYPES}
    cfg = loaded["float32"].config
    ids = list(loaded["float32"].tokenizer(Path(args.text).read_text())["input_ids"])
    params = {d: reference_params(m.params) for d, m in loaded.items()}
    report = {"window": args.window, "chunk": args.chunk, "max_tokens": args.max_tokens,
              "teacher_forced": teacher_forced(params, cfg, ids, args.window, args.chunk),
              "jax": jax.__version__, "backend": jax.default_backend()}
    return accuracy.finish(report, args, start, "accuracy_bf16", markdown,
                           lambda: greedy(loaded, args.max_tokens))


if __name__ == "__main__":
    main()
