"""The benchmarks' workloads, seeded so every engine and rerun sees the same requests: the
bundled prompts (package data: bench_prompts.json, short / medium / long {"id", "kind", "text"};
system_prompt.txt, ~850 tokens), output lengths, arrivals. Only numpy: vLLM's venv imports it."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxbatch.benchmarks.base import add_flags

DATA = Path(__file__).resolve().with_name("data")
DEFAULT_PROMPTS = DATA / "bench_prompts.json"
SYSTEM_PROMPT = DATA / "system_prompt.txt"
SHORT_KINDS = ("short", "medium")


@dataclasses.dataclass
class Request:
    """One request of an in-process benchmark (token ids, not text)."""
    rid: str
    prompt_ids: list[int]
    output_len: int
    arrival: float = 0.0          # seconds after the start of the timed run
    kind: str = "short"           # kind of the bundled prompt: short / medium / long


@dataclasses.dataclass
class ServeRequest:
    """One request of the served workload (text; the server applies its chat template)."""
    idx: int
    prompt_id: str
    kind: str
    text: str
    max_tokens: int
    gap: float          # standard exponential; the arrival gap is gap / rate


def load_prompts(path=DEFAULT_PROMPTS) -> list[dict]:
    return json.loads(Path(path).read_text())["prompts"]


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode_prompts(entries, tokenizer) -> list[list[int]]:
    """Chat-templated token ids: what an instruct model is actually served."""
    return [chat_ids(tokenizer, [{"role": "user", "content": e["text"]}]) for e in entries]


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """round(median * exp(sigma * N(0, 1))) clipped to [lo, hi]: a long tail of outputs."""
    return [int(x) for x in np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))),
                                    lo, hi)]


def poisson_arrivals(rng, n: int, rate: float) -> np.ndarray:
    """Arrival times (s) of a Poisson process: cumulative exponential gaps of mean 1 / rate."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


def _truncate(ids, max_len):
    return ids if max_len is None or len(ids) <= max_len else ids[-max_len:]


def offline_requests(prompt_ids, kinds, n, lengths, seed, max_prompt_len=None) -> list[Request]:
    """n requests at t=0; prompts uniform over the set, output lengths from `lengths`
    (median, sigma, lo, hi)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(prompt_ids), n)
    outs = lognormal_lengths(rng, n, *lengths)
    return [Request(f"off-{i}", _truncate(prompt_ids[p], max_prompt_len), outs[i], 0.0, kinds[p])
            for i, p in enumerate(picks)]


def online_requests(prompt_ids, kinds, n_short, n_long, rate, lengths, seed,
                    max_prompt_len=None) -> list[Request]:
    """Poisson arrivals at `rate`: n_short short/medium prompts with n_long long prompts at
    random positions among them."""
    rng = np.random.default_rng(seed + 1)
    short = [i for i, k in enumerate(kinds) if k in SHORT_KINDS]
    long_ = [i for i, k in enumerate(kinds) if k not in SHORT_KINDS] or short
    picks = list(rng.choice(short, n_short)) + list(rng.choice(long_, n_long))
    picks = [picks[i] for i in rng.permutation(len(picks))]
    arrivals = poisson_arrivals(rng, len(picks), rate)
    outs = lognormal_lengths(rng, len(picks), *lengths)
    return [Request(f"on-{i}", _truncate(prompt_ids[p], max_prompt_len), outs[i],
                    float(arrivals[i]), kinds[p]) for i, p in enumerate(picks)]


def add_workload_flags(ap) -> None:
    """The mixed chat workload's flags, which `serve_workload` reads."""
    add_flags(ap, num_prompts=48, output_median=32.0, output_sigma=1.0, output_min=8,
              output_max=256, seed=0, prompts=str(DEFAULT_PROMPTS))


def serve_workload(args) -> list[ServeRequest]:
    lengths = (args.output_median, args.output_sigma, args.output_min, args.output_max)
    return make_workload(args.num_prompts, lengths, args.seed, args.prompts)


def make_workload(num_prompts: int, lengths=(32, 1.0, 8, 256), seed: int = 0,
                  prompts_path=DEFAULT_PROMPTS) -> list[ServeRequest]:
    """The mixed chat workload (serve, profile, vs-vllm): the same requests whatever the rate;
    prompts uniform over the bundled set, lognormal output lengths, one draw of arrival gaps."""
    entries = load_prompts(prompts_path)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(entries), num_prompts)
    outs = lognormal_lengths(rng, num_prompts, *lengths)
    gaps = rng.standard_exponential(num_prompts)
    gaps[0] = 0.0       # the first request goes at t=0, as in vllm bench serve
    return [ServeRequest(i, entries[p]["id"], entries[p]["kind"], entries[p]["text"], outs[i],
                         float(gaps[i])) for i, p in enumerate(picks)]


def arrival_offsets(workload, rate: float) -> list[float]:
    """Send times of a ServeRequest workload at `rate` req/s (inf: all at t=0)."""
    return list(np.cumsum([r.gap / rate for r in workload]))        # gap / inf = 0
