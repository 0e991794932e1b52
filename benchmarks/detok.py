"""Host cost of turning generated tokens into text, per token, at long outputs.

    python -m benchmarks detok [--tokens 2048] [--repeats 3]

"before": what the engine did per step until the incremental detokenizer (its former
`_apply_stop_strings`): decode the whole output every step, then search the whole text for
the stop strings (O(n) per token).
"after": jaxbatch.engine.detokenizer.IncrementalDetokenizer, as the engine now uses it every
step (`RequestState.apply_stop_strings` calls `update`; the step's output carries
`output_text`). Both run on the embedded model's tokenizer over
the same token stream (real multilingual text, so multi-byte characters are split across
tokens) with two stop strings that never match, so the whole output is searched.
"""
from __future__ import annotations

import argparse
import statistics
import time

from jaxbatch.engine.detokenizer import IncrementalDetokenizer

TEXT = ("The river that crosses the old city carried barges of grain, wine and timber. "
        "Café, naïve, jalapeño — 日本語のテキスト, 中文文本, 한국어 🙂🎉 ∑∫√∞. ")
STOP = ["<never-1>", "###never###"]


def before(tok, ids):
    """The old per-step work, for every prefix of `ids`; returns seconds per token by position."""
    times = []
    for n in range(1, len(ids) + 1):
        t = time.perf_counter()
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in STOP if s in text]
        if hits:
            text = text[:min(hits)[0]]
        times.append(time.perf_counter() - t)
    return times, text


def after(tok, ids):
    times = []
    detok = IncrementalDetokenizer(tok, True, STOP)
    out = []
    for n in range(1, len(ids) + 1):
        out.append(ids[n - 1])
        t = time.perf_counter()
        detok.update(out, final=n == len(ids))
        text = detok.output_text(n == len(ids))
        times.append(time.perf_counter() - t)
    return times, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks detok", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    tok = load_tokenizer(embedded_gguf_path())
    ids = []
    while len(ids) < args.tokens:
        ids += tok(TEXT)["input_ids"]
    ids = ids[:args.tokens]
    results = {}
    for name, fn in (("before (full re-decode)", before), ("after (incremental)", after)):
        runs = []
        for _ in range(args.repeats):
            times, text = fn(tok, ids)
            runs.append(times)
        results[name] = text
        best = min(runs, key=sum)
        tail = best[-256:]
        print(f"{name:26s} mean {1e6 * sum(best) / len(best):8.1f} us/token over {len(ids)} tokens"
              f" | last 256 tokens {1e6 * statistics.mean(tail):8.1f} us/token"
              f" | first 256 {1e6 * statistics.mean(best[:256]):7.1f} us/token"
              f" | total {sum(best) * 1e3:7.1f} ms")
    texts = list(results.values())
    assert texts[0] == texts[1], "the two methods disagree"
    print("texts identical:", len(texts[0]), "characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
