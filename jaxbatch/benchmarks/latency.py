"""`jaxbatch bench latency`: time to first token under Poisson arrivals, chunked prefill vs
chunking disabled -- the throughput benchmark's `online` workload (see throughput.py; every
flag of `jaxbatch bench throughput` applies)."""
from __future__ import annotations

from jaxbatch.benchmarks.throughput import Throughput


class Latency(Throughput):
    name, workloads = "latency", ("online",)


main = Latency().main
