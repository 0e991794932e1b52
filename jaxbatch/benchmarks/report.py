"""One report writer for every benchmark: table cells, markdown tables, JSON, PNG plots, and the
cost per million output tokens at a price per hour."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np


def fmt(x, digits=1) -> str:
    """A number for a table cell; '-' when there is none."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def stats_ms(values) -> dict:
    """Mean, median and p99 of seconds, in milliseconds (None when there are no values)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    arr = 1e3 * np.asarray(values, np.float64)
    return {"mean_ms": float(arr.mean()), "median_ms": float(np.median(arr)),
            "p99_ms": float(np.percentile(arr, 99))}


def trio(s: dict, digits: int = 0) -> str:
    """'mean/median/p99' of a stats_ms dict."""
    return "/".join(fmt(s[k], digits) for k in ("mean_ms", "median_ms", "p99_ms"))


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def cost_per_million(output_tokens_per_s, usd_per_hour) -> float | None:
    """USD per million output tokens at this throughput on a machine of this hourly price."""
    if not output_tokens_per_s or usd_per_hour is None:
        return None
    return usd_per_hour / (output_tokens_per_s * 3600.0) * 1e6


def cost_cell(output_tokens_per_s, price: dict) -> str:
    """A table cell: '$0.123' (the price is stated once, in `price_line`)."""
    c = cost_per_million(output_tokens_per_s, price.get("usd_per_hour"))
    return "n/a" if c is None else f"${c:.3f}"


def price_line(price: dict) -> str:
    """The sentence under a table that says what the '$ / M out tok' column assumes."""
    if price.get("usd_per_hour") is None:
        return f"Cost per million output tokens: not computed ({price.get('source')})."
    return (f"Cost per million output tokens ($ / M out tok) at ${price['usd_per_hour']:.4f} "
            f"per hour ({price['source']}).")


def to_json(obj):
    """json.dumps default: an object's own `to_json()`, numpy values, dataclasses, else str."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def write_json(path: Path, report: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=to_json))
    return path


def write_report(out_dir, name: str, report: dict, md: str) -> list[Path]:
    paths = [write_json(Path(out_dir) / f"{name}.json", report), Path(out_dir) / f"{name}.md"]
    paths[1].write_text(md + "\n")
    return paths


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path).name


def cdf(ax, values, label) -> None:
    values = np.sort(values)
    ax.step(values, np.arange(1, len(values) + 1) / max(1, len(values)), where="post", label=label)
