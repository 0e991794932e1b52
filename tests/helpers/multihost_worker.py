"""One process of a 2-process engine (test_multihost.py starts two of these, each seeing 2 CPU
devices, joined by jax.distributed over localhost; tensor_parallel_size=4 spans both).
The same script runs in every process, as a JAX multi-controller program does; process 0
prints the tokens as JSON, the other follows."""
from __future__ import annotations

import json
import sys

from jaxbatch.engine import multihost


def workload():
    """Shared with the single-process reference in test_multihost.py."""
    import numpy as np
    from jaxbatch import SamplingParams
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(2, 60, size=10)]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.9])), seed=i, top_k=20,
                             max_tokens=int(rng.integers(4, 20)), ignore_eos=True)
              for i in range(10)]
    return prompts, params


def main(process_id: int, port: int) -> None:
    multihost.initialize(f"localhost:{port}", 2, process_id)   # before any device is touched
    import jax
    from jaxbatch import LLM, SamplingParams
    from tp_checks import SETTINGS, model
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    # KV events from process 0 alone: a follower binding the same endpoint would fail here
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port + 1}",
              "publisher": "zmq"}
    llm = LLM(loaded=model(2), tensor_parallel_size=4, num_processes=2, process_id=process_id,
              coordinator_address=f"localhost:{port}", kv_events_config=events,
              prefix_cache_granularity="block", **SETTINGS)
    from jaxbatch.kv_events.config import NO_KV_EVENTS
    assert (llm.llm_engine.engine.kv_events is NO_KV_EVENTS) == (process_id != 0)
    prompts, params = workload()
    # Two batches: followers return from one generate() and follow the next.
    first = llm.generate(prompts[:4], params[:4], use_tqdm=False)
    second = llm.generate(prompts[4:], params[4:], use_tqdm=False)
    engine = llm.llm_engine
    # An abort between steps reaches every process.
    if process_id == 0:
        engine.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=50))
        engine.add_request("y", prompts[1], SamplingParams(temperature=0, max_tokens=5))
        engine.step()
        engine.abort_request("x")
        aborted = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                aborted[out.request_id] = out.outputs[0].finish_reason
        engine.release()
        assert engine.engine.kv_events.num_events > 0     # the prefix cache's blocks, published
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        engine.shutdown()
        print("RESULT " + json.dumps({
            "tokens": [o.outputs[0].token_ids for o in first + second],
            "aborted": aborted, "tp": stats["tensor_parallel_size"]}), flush=True)
    else:
        assert first == second == []
        assert engine.follow() is True        # the abort batch
        assert engine.follow() is False       # shutdown
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        print(f"process {process_id} followed {stats['num_steps']} steps", flush=True)


def single() -> None:
    """The reference: one process, one device, no tensor parallelism, the same workload (all
    at once: batch invariance makes the split into batches invisible)."""
    from jaxbatch.engine.llm_engine import LLMEngine
    from tp_checks import SETTINGS, model, run_all
    prompts, params = workload()
    print("RESULT " + json.dumps({"tokens": run_all(LLMEngine(loaded=model(2), **SETTINGS),
                                                    prompts, params)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "single":
        single()
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
