"""`python -m benchmarks [NAME [ARGS]]`: lists the instruments, or runs one (its `main(argv)`),
through `jaxbatch bench`'s dispatcher. Importing a module only once its name is chosen keeps the
list instant, and lets scaleout set its virtual devices before JAX starts."""
from __future__ import annotations

import sys

from benchmarks import INSTRUMENTS
from jaxbatch.benchmarks.registry import dispatch


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return dispatch(argv, "python -m benchmarks", {k: line for k, (_, line) in INSTRUMENTS.items()},
                    lambda name: f"benchmarks.{INSTRUMENTS[name][0]}",
                    ["Instruments live outside the wheel; run them from a checkout. What users "
                     "run is `jaxbatch bench` (throughput, latency, serve, ...)."])


if __name__ == "__main__":
    sys.exit(main())
