"""`jaxbatch bench latency`: time to first token under Poisson arrivals, chunked prefill vs
chunking disabled -- the throughput benchmark's `online` workload (see throughput.py; every
flag of `jaxbatch bench throughput` applies)."""
from __future__ import annotations

from jaxbatch.benchmarks import throughput


def main(argv=None) -> dict:
    return throughput.main(argv, workloads=("online",), prog="jaxbatch bench latency")


if __name__ == "__main__":
    main()
