"""`python -m benchmarks [NAME [ARGS]]`: lists the instruments, or runs one (its `main(argv)`).
Importing a module only once its name is chosen keeps the list instant, and lets scaleout set
its virtual devices before JAX starts."""
from __future__ import annotations

import importlib
import sys

from benchmarks import INSTRUMENTS


def usage() -> str:
    width = max(map(len, INSTRUMENTS))
    return "\n".join(["usage: python -m benchmarks NAME [ARGS ...]   (NAME --help: its flags)",
                      "", "instruments (outside the wheel; run from a checkout):"]
                     + [f"  {name:<{width}}  {line}" for name, (_, line) in INSTRUMENTS.items()]
                     + ["", "What users run is `jaxbatch bench` (throughput, latency, serve, ...)."])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] not in INSTRUMENTS:
        print(f"python -m benchmarks: unknown instrument {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{INSTRUMENTS[argv[0]][0]}")
    result = module.main(argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
