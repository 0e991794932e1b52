"""The base every `jaxbatch bench NAME` stands on: a subclass whose module docstring is its
--help, with its flags (`add_arguments`), what it measures (`bench`) and its table (`markdown`);
`main(argv)` runs it on a stated machine, prices it, writes <out>/<report_name>.json and .md."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jaxbatch.benchmarks.machine import add_price_argument, machine_info, resolve_price
from jaxbatch.benchmarks.report import price_line, write_report


def add_flags(ap, **defaults) -> None:
    """A flag per keyword, --name-with-dashes, typed as its default; a (default, help) pair
    gives it a help line."""
    for name, value in defaults.items():
        default, help_ = value if isinstance(value, tuple) else (value, None)
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                        help=help_)


class Benchmark:
    name = ""
    prog = ""               # default `jaxbatch bench <name>`
    report_name = ""        # default bench_<name>
    out = "bench_out"       # --out's default
    model_free = False      # a client of other processes: the machine is stated without JAX

    def add_arguments(self, ap) -> None:
        pass

    def check(self, args) -> str | None:
        """Why these flags cannot run (argparse says it), or None."""

    def load(self, args):
        from jaxbatch.model.loader import load_model
        return load_model(dtype=getattr(args, "dtype", "float32"))

    def bench(self, loaded, args) -> dict:
        raise NotImplementedError

    def markdown(self, report) -> str:
        raise NotImplementedError

    def plots(self, report, out_dir: Path) -> list[str]:
        return []

    def parser(self) -> argparse.ArgumentParser:
        doc = sys.modules[type(self).__module__].__doc__ or ""
        description, _, epilog = doc.partition("\n\n")
        ap = argparse.ArgumentParser(prog=self.prog or f"jaxbatch bench {self.name}",
                                     description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_arguments(ap)
        ap.add_argument("--out", default=self.out)
        add_price_argument(ap)
        return ap

    def main(self, argv=None) -> dict:
        ap = self.parser()
        args = ap.parse_args(argv)
        if (error := self.check(args)) is not None:
            ap.error(error)
        start = time.perf_counter()
        report = {"machine": machine_info(with_jax=not self.model_free),
                  "command": " ".join(sys.argv), "args": vars(args)}
        report.update(self.bench(None if self.model_free else self.load(args), args))
        report["bench_seconds"] = time.perf_counter() - start
        report["machine"]["loadavg_at_end"] = os.getloadavg()    # other jobs share machines
        report["price"] = resolve_price(args.price_per_hour, report["machine"])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report["plots"] = self.plots(report, out)
        md = self.markdown(report) + "\n\n" + price_line(report["price"])
        paths = write_report(out, self.report_name or f"bench_{self.name}", report, md)
        print(f"\nwrote {', '.join(str(p) for p in paths + report['plots'])} in "
              f"{report['bench_seconds']:.0f} s\n\n{md}")
        return report
