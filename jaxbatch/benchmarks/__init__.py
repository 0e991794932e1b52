"""Benchmarks as a tool: `jaxbatch bench NAME` (registry.py lists the names), one module per
benchmark with `main(argv)`, over a small library -- workloads.py (bundled prompts, output
lengths, arrivals), harness.py (drive an engine, vllm bench serve's metrics), report.py (JSON,
markdown, PNG, cost per million output tokens), machine.py (machine info, list prices) and
observer.py (the step hooks benchmarks attach to). Importing this package imports nothing."""
