"""KV events: what enters and leaves the prefix cache, published as vLLM publishes it, so a
router written for vLLM (llm-d's precise prefix-cache scorer, the Gateway API Inference
Extension) indexes jaxbatch pods unchanged.

    config.py     KVEventsConfig: the `--kv-events-config` JSON (vLLM's keys), checked
    hashing.py    vLLM's block hashes: sha256 over canonical CBOR, chained from NONE_HASH
    events.py     the wire records (vLLM's msgspec classes' schema: BlockStored, ...)
    recorder.py   the prefix cache's observer: turns stores, evictions and resets into
                  events, one batch per engine step
    publisher.py  ZMQ PUB (topic, sequence number, payload) + the ROUTER replay socket

Host side only: no JAX. pyzmq, msgspec and cbor2 are imported only when events are enabled
(`pip install jaxbatch[kv-events]`).
"""
