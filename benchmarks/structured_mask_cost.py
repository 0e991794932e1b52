"""Host cost of structured outputs on the embedded model's tokenizer, without running the model:
the llguidance tokenizer build (once per engine), a JSON schema's compile, and one step's
matcher advance + bitmask fill for R rows (each row a sequence at a different point of the
same schema). Usage: python -m benchmarks structured-mask-cost [ROWS ...]"""
from __future__ import annotations

import json
import statistics
import sys
import time

from jaxbatch import SamplingParams, StructuredOutputsParams
from jaxbatch.core.request import Sequence
from jaxbatch.model.loader import load_model
from jaxbatch.structured.manager import StructuredOutputManager

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]},
                  separators=(",", ":"))


def main(argv=None):
    rows_list = [int(a) for a in (sys.argv[1:] if argv is None else argv)] or [4, 16, 64]
    loaded = load_model(dtype="float32")
    tok = loaded.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    m = StructuredOutputManager(tok, loaded.config.vocab_size, tuple(loaded.config.eos_token_ids))
    # Measured from outside: the first check builds the tokenizer's grammar side too, a second
    # schema then compiles alone.
    t = time.perf_counter()
    m.check(SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})))
    print(f"tokenizer build + first schema: {time.perf_counter() - t:.3f} s")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    t = time.perf_counter()
    m.check(params)
    print(f"schema compile: {1e3 * (time.perf_counter() - t):.2f} ms")
    for rows in rows_list:
        seqs = [Sequence(i, str(i), 0, [1], params, 0, 0.0, 0, 0) for i in range(rows)]
        for k, s in enumerate(seqs):
            s.output_token_ids = list(ids[:k % (len(ids) // 2)])
            m.add(s)
        sampling = [type("Row", (), {"seq_id": s.seq_id})() for s in seqs]
        times = []
        for step in range(len(ids) // 2):
            t = time.perf_counter()
            for s in seqs:                        # every row one token further along
                s.output_token_ids.append(ids[len(s.output_token_ids)])
                m.advance(s)
            m.fill_bitmask(sampling)
            times.append(time.perf_counter() - t)
        for s in seqs:
            m.remove(s.seq_id)
        print(f"{rows:4d} rows: advance + fill per step median {1e3 * statistics.median(times):.3f} ms,"
              f" max {1e3 * max(times):.3f} ms over {len(times)} steps; rejected {m.num_rejected_tokens}")


if __name__ == "__main__":
    main()
