"""Tensor-parallel checks, run by test_tensor_parallel.py in a subprocess that sees 8 virtual
CPU devices (the rest of the suite keeps one). Each check asserts; the test asserts exit 0.

Tiny random models with 8 query heads and 8 or 2 KV heads (the embedded model's 9 / 3 heads
split no useful way), built here from numpy so no torch import slows the subprocess down.
"""
from __future__ import annotations

import re
import sys
import time

import jax
import numpy as np

from jaxbatch import SamplingParams
from jaxbatch.engine.build import build_engine
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel

VOCAB, HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM = 256, 128, 256, 2, 8, 16


def tiny_model(kv_heads: int, seed: int = 0, tied: bool = False, qkv_bias: bool = False):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_layers=LAYERS, num_heads=HEADS, num_kv_heads=kv_heads,
                      head_dim=HEAD_DIM, tie_word_embeddings=tied, qkv_bias=qkv_bias,
                      max_position_embeddings=1024, eos_token_ids=(2,))
    rng = np.random.default_rng(seed)
    # Weights ~ 1/sqrt(fan_in), so logits are far from uniform and greedy ties are rare.
    w = lambda i, o: (rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32)
    norm = lambda: (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    layers = []
    for _ in range(LAYERS):
        layer = {"attn_norm": norm(), "mlp_norm": norm(),
                 "wq": w(HIDDEN, HEADS * HEAD_DIM), "wk": w(HIDDEN, kv_heads * HEAD_DIM),
                 "wv": w(HIDDEN, kv_heads * HEAD_DIM), "wo": w(HEADS * HEAD_DIM, HIDDEN),
                 "w_gate": w(HIDDEN, FFN), "w_up": w(HIDDEN, FFN), "w_down": w(FFN, HIDDEN)}
        if qkv_bias:
            for name, n in (("bq", HEADS), ("bk", kv_heads), ("bv", kv_heads)):
                layer[name] = (0.5 * rng.standard_normal(n * HEAD_DIM)).astype(np.float32)
        layers.append(layer)
    params = {"embed": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
              "layers": layers, "final_norm": norm()}
    if not tied:
        params["lm_head"] = w(HIDDEN, VOCAB)
    params = jax.tree.map(lambda a: jax.numpy.asarray(a), params)
    return LoadedModel(cfg, params, tokenizer=None, source="tiny-tp", load_seconds=0.0,
                       from_cache=False)


# One engine per (KV heads, tp), shared by the checks: compiling the step shapes is most of
# what these checks cost on two CPU cores. The pool is small enough to force preemption.
SETTINGS = dict(max_num_seqs=4, block_size=32, num_blocks=6, max_model_len=128,
                prefill_chunk_size=32, warmup=False, compilation_cache=False)
_MODELS: dict[int, LoadedModel] = {}
_ENGINES: dict[tuple[int, int], LLMEngine] = {}


def model(kv: int) -> LoadedModel:
    """8 KV heads: untied LM head; 2 KV heads: tied embeddings. Both with qkv bias."""
    if kv not in _MODELS:
        _MODELS[kv] = tiny_model(kv, seed=kv, tied=kv == 2, qkv_bias=True)
    return _MODELS[kv]


def engine(kv: int, tp: int) -> LLMEngine:
    if (kv, tp) not in _ENGINES:
        _ENGINES[kv, tp] = LLMEngine(loaded=model(kv), tensor_parallel_size=tp, **SETTINGS)
    return _ENGINES[kv, tp]


def run_all(eng: LLMEngine, prompts, params, whole: bool = False) -> list:
    """Token ids of each request's first completion (`whole`: the RequestOutput)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out if whole else out.outputs[0].token_ids
    stats = eng.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    return [done[str(i)] for i in range(len(prompts))]


def _logprob_values(out) -> list[float]:
    """Every logprob a RequestOutput carries (sampled and prompt), in a fixed order."""
    values = []
    for entry in (out.outputs[0].logprobs or []) + (out.prompt_logprobs or []):
        values += [] if entry is None else [entry[k] for k in sorted(entry)]
    return values


def prompts_of(rng, lengths):
    return [rng.integers(3, VOCAB, size=int(n)).tolist() for n in lengths]


def _prefill_logits(eng: LLMEngine, prompts) -> np.ndarray:
    """Logits of every prompt's last token, through the runner's prefill call (one chunk each)."""
    out = []
    for i, p in enumerate(prompts):
        eng.add_request(f"logits{i}", p, SamplingParams(temperature=0, max_tokens=1))
        captured = {}
        dispatch_run = eng.runner._run

        def spy(key, args, _run=dispatch_run):
            result = _run(key, args)
            if key[0] == "prefill":
                captured["logits"] = np.asarray(eng.runner.tp.to_host(result[0])
                                                if eng.runner.tp else result[0])
            return result
        eng.runner._run = spy
        while eng.has_unfinished_requests():
            eng.step()
        eng.runner._run = dispatch_run
        out.append(captured["logits"][0])
    return np.stack(out)                                                          # [P, V]


# ---- checks --------------------------------------------------------------------------------
def check_logits():
    """tp = 2, 4, 8 within 1e-5 of tp = 1, for 8 and 2 KV heads (the latter copies KV heads
    at tp = 4, 8); prompts that take several prefill chunks."""
    prompts = prompts_of(np.random.default_rng(1), [7, 60])
    for kv in (8, 2):
        ref = _prefill_logits(engine(kv, 1), prompts)
        for tp in (2, 4, 8):
            got = _prefill_logits(engine(kv, tp), prompts)
            err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
            print(f"kv={kv} tp={tp} max rel err of the logits {err:.2e}")
            assert err < 1e-5, (kv, tp, err)


def check_greedy_64():
    """64 greedy tokens identical to tp = 1's at tp = 8 (2 KV heads, each copied four times);
    the small pool preempts on the way. (Every tp and both head counts: check_logits.)"""
    prompts = prompts_of(np.random.default_rng(2), [3, 20, 61])
    sp = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * len(prompts)
    for kv, tp in ((2, 8),):
        ref = run_all(engine(kv, 1), prompts, sp)
        assert all(len(t) == 64 for t in ref)
        assert run_all(engine(kv, tp), prompts, sp) == ref, (kv, tp)
        print(f"kv={kv} tp={tp}: 64 greedy tokens x {len(prompts)} identical")


def check_engine_mixed_with_preemption():
    """50 mixed requests (greedy and seeded sampling, logprobs and prompt logprobs, mixed
    lengths) on a pool small enough to force preemption: identical tokens at tp = 1 and
    tp = 8 (2 KV heads, copied 4 times), logprobs within 1e-4."""
    rng = np.random.default_rng(3)
    prompts = prompts_of(rng, rng.integers(2, 70, size=50))
    sp = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i,
                         top_k=int(rng.choice([0, 20])), max_tokens=int(rng.integers(1, 24)),
                         logprobs=2 if i % 5 == 0 else None,
                         prompt_logprobs=1 if i % 12 == 0 else None,
                         ignore_eos=True) for i in range(50)]
    outs, preempted = {}, {}
    for tp in (1, 8):
        eng = engine(2, tp)
        before = eng.stats()["num_preemptions"]
        outs[tp] = run_all(eng, prompts, sp, whole=True)
        preempted[tp] = eng.stats()["num_preemptions"] - before
    print("preemptions", preempted)
    assert preempted[1] > 0 and preempted[1] == preempted[8], preempted
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[8]]
    lp1 = np.concatenate([_logprob_values(o) for o in outs[1]])
    lp8 = np.concatenate([_logprob_values(o) for o in outs[8]])
    assert len(lp1) > 100 and np.allclose(lp1, lp8, atol=1e-4), np.max(np.abs(lp1 - lp8))


def check_pallas_kernels_per_shard():
    """The Pallas decode and ragged kernels (interpret mode on CPU) under shard_map at tp = 2
    give the single-device xla backend's greedy tokens."""
    prompts = prompts_of(np.random.default_rng(8), [5, 40])
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    ref = run_all(engine(8, 1), prompts, sp)
    kernels = LLMEngine(loaded=model(8), tensor_parallel_size=2,
                        **{**SETTINGS, "attention_backend": "pallas_interpret"})
    assert kernels.stats()["attention_backend"] == "pallas_interpret"
    assert run_all(kernels, prompts, sp) == ref


def _hlo_of(eng: LLMEngine, key) -> str:
    r = eng.runner
    return r.executables.lower(key, r.example_args(key)).compile().as_text()


def check_hlo_collectives_and_donation():
    """The compiled decode, prefill and mixed steps (a bucket of each): all-reduces (two per
    layer, in the scan body),
    no all-gather of any weight-sized array, and the pool donated (aliased input -> output,
    never copied), at tp = 4 with 2 KV heads (copied) and 8."""
    for kv in (8, 2):
        eng = engine(kv, 4)
        r = eng.runner
        local_pool = "f32[" + ",".join(str(d) for d in
                                       (r.pool[0].shape[0] // 4,) + r.pool[0].shape[1:]) + "]"
        weight_shapes = {tuple(a.shape) for a in jax.tree.leaves(r.params) if a.ndim >= 2}
        n_leaves = len(jax.tree.leaves(r.params))
        keys = r.layout.bucket_shapes()
        assert {k[0] for k in keys} == {"decode", "prefill", "mixed"}
        for key in (keys[0], next(k for k in keys if k[0] == "prefill"), keys[-1]):
            text = _hlo_of(eng, key)
            all_reduces = re.findall(r"= \S+ all-reduce(?:-start)?\(", text)
            # One after attention, one after the MLP, in the layer body the scan compiles once.
            assert len(all_reduces) == 2, (key, all_reduces)
            assert not re.search(r" (all-to-all|collective-permute|reduce-scatter)", text), key
            # The only gather: the vocab-parallel LM head's logits [rows, V], never a weight.
            gathers = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", text)
            for dims in gathers:
                shape = tuple(int(d) for d in dims.split(",") if d)
                assert shape not in weight_shapes and shape[-1] == VOCAB, (key, shape)
            # Each device holds its slice of the split weights (here wq, [L, d, H*Dh / tp]).
            wq = re.search(r"f32\[([\d,]+)\]\{[^}]*\} parameter\(\d+\), sharding=.*?, "
                           r"metadata=\{op_name=\"params\[\\'layers\\'\]\[\\'wq\\'\]", text)
            assert wq and wq.group(1) == f"{LAYERS},{HIDDEN},{HEADS * HEAD_DIM // 4}", key
            header = text.splitlines()[0]
            aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
            aliased = sorted(int(p) for p in re.findall(r"\((\d+), \{\}", aliases.group(1)))
            assert aliased == [n_leaves, n_leaves + 1], (key, header[:300])
            copies = [l for l in text.splitlines()
                      if re.search(re.escape(local_pool) + r"\{[^}]*\} copy\(", l)]
            assert not copies, (key, copies[:2])
            print(f"kv={kv} {key}: {len(all_reduces)} all-reduces, pool aliased, no weight gather")
        # And at run time: the pool's buffers are reused, not reallocated.
        before = [s.data.unsafe_buffer_pointer() for s in r.pool[0].addressable_shards]
        run_all(eng, [[5, 6, 7, 8]], [SamplingParams(temperature=0, max_tokens=3)])
        after = [s.data.unsafe_buffer_pointer() for s in r.pool[0].addressable_shards]
        assert before == after
        assert r.pool[0].sharding.spec[0] == "tp"


def check_bad_settings():
    """Settings that cannot be split are refused with a ValueError naming the setting."""
    cases = [(model(2), 3, "num_heads"), (model(2), 16, "8 given")]
    twelve = ModelConfig(**{**model(8).config.__dict__, "num_heads": 12, "num_kv_heads": 4})
    cases.append((LoadedModel(twelve, model(8).params, None, "tiny", 0.0, False), 6, "num_kv_heads"))
    for loaded, tp, words in cases:
        try:
            LLMEngine(loaded=loaded, tensor_parallel_size=tp, **SETTINGS)
        except ValueError as e:
            assert words in str(e), e
            print(f"tp={tp}: ValueError: {e}")
        else:
            raise AssertionError(f"tp={tp} accepted")


def check_data_parallel_replicas_on_their_own_devices():
    """data_parallel_size=2 x tensor_parallel_size=2: each replica's pool on its own 2
    devices, outputs those of one single-device engine."""
    rng = np.random.default_rng(7)
    prompts = prompts_of(rng, rng.integers(2, 30, size=6))
    sp = [SamplingParams(temperature=0.7, seed=i, max_tokens=int(rng.integers(2, 8)),
                         ignore_eos=True) for i in range(6)]
    ref = run_all(engine(2, 1), prompts, sp)
    dp = build_engine(loaded=model(2), data_parallel_size=2, tensor_parallel_size=2, **SETTINGS)
    devices = [set(r.runner.pool[0].sharding.device_set) for r in dp.replicas]
    assert len(devices[0]) == len(devices[1]) == 2 and not devices[0] & devices[1], devices
    assert run_all(dp, prompts, sp) == ref
    assert all(r.stats()["num_steps"] > 0 for r in dp.replicas)
    print("replica devices", [sorted(d.id for d in group) for group in devices])


CHECKS = [check_bad_settings, check_logits, check_greedy_64, check_engine_mixed_with_preemption,
          check_hlo_collectives_and_donation, check_pallas_kernels_per_shard,
          check_data_parallel_replicas_on_their_own_devices]


def main(names) -> int:
    """Runs the named checks (all by default), one line per check: `CHECK name PASS|FAIL`."""
    import traceback
    failed = 0
    for check in CHECKS:
        if names and check.__name__ not in names:
            continue
        start = time.perf_counter()
        try:
            check()
            status = "PASS"
        except Exception:
            traceback.print_exc()
            status, failed = "FAIL", failed + 1
        print(f"CHECK {check.__name__} {status} {time.perf_counter() - start:.1f}s", flush=True)
    return failed


if __name__ == "__main__":
    assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    sys.exit(main(sys.argv[1:]))
