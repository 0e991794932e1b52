"""jaxbatch's OpenAI-compatible server (`jaxbatch serve`). Where an HTTP request is, in order:

1. cli.py           uvicorn listens; the engine thread is loading (/health 503 until ready).
2. app.py           FastAPI parses the body into a protocol.py model (a schema error -> 400),
                    checks the API key (401) on /v1 routes, wraps the handler in
                    `with_cancellation` (a client that disconnects cancels it).
3. serving.py       `AsyncLLM.admit()` counts it against --max-num-queued-reqs (503 if full,
                    starting or draining); SamplingParams are checked (400); the chat template
                    and the tokenizer run in a worker thread, never on the event loop; a prompt
                    too long for max_model_len -> 400.
4. async_engine.py  `add_request` puts an "add" command on the engine thread's list and waits
                    for the engine's verdict (LLMEngine.add_request raising -> 400). No byte has
                    been sent so far, so every error above is a proper HTTP error.
5. engine thread    drains commands, runs `LLMEngine.step()` (which dispatches the next step
                    before reading this one's tokens: host/device overlap), and hands all of the
                    step's cumulative outputs to the event loop in one `call_soon_threadsafe`; each
                    request's mailbox keeps only the newest (a slow reader's deltas merge).
                    Text comes from the incremental detokenizer (jaxbatch/engine/detokenizer.py):
                    no half characters, nothing of a stop string that may still match.
6. serving.py       turns cumulative outputs into OpenAI deltas: SSE frames for `stream: true`
                    (then `data: [DONE]`), or one JSON body when the final output arrives.
                    (/v1/responses: responses_protocol.py makes it a chat request, responses.py
                    shapes its output items and events.)
7. the end          finished, or aborted when the client leaves (the generator's `finally`);
                    the engine frees the request's KV blocks on the next step. metrics.py has
                    recorded its tokens and latencies for /metrics.
"""
