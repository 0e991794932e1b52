"""What machine a benchmark ran on (every report states it: a shared 2-core VM and an H200 are
not comparable, and CPU flags decide how fast bfloat16 runs), and what an hour of it costs."""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess

# CPU flags that change which dtype is fast here (DESIGN.md, "This CPU").
INTERESTING_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8",
                     "amx_tile")

# On-demand list prices, USD per vCPU-hour, Linux, us-east-1, of the general-purpose AWS family
# of the CPU's vendor (m7i.large: 2 vCPU Sapphire Rapids; m7a.large: 2 vCPU Genoa), checked
# against AWS's price list when written (2026-12).
CPU_PRICES = {
    "intel": (0.0504, "AWS m7i on-demand (us-east-1), $0.0504 per vCPU-hour"),
    "amd": (0.05796, "AWS m7a on-demand (us-east-1), $0.05796 per vCPU-hour"),
}


def _cpuinfo(field: str) -> str | None:
    try:
        return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith(field)), None)
    except OSError:
        return None


def cpu_model() -> str | None:
    if (model := _cpuinfo("model name")) is not None:
        return model
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines()
                    if l.startswith("Model name"))
    except (OSError, StopIteration):
        return None


def cpu_flags() -> list[str]:
    have = set((_cpuinfo("flags") or "").split())
    return [f for f in INTERESTING_FLAGS if f in have]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_info(with_jax: bool = True) -> dict:
    """Date, Python, CPU (model, cores, flags), load, and -- unless with_jax=False (a venv
    without jaxbatch's JAX, e.g. vLLM's) -- jax's version, backend and device."""
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_model": cpu_model(), "cpu_count": cpu_count(), "cpu_flags": cpu_flags(),
            "loadavg_at_start": os.getloadavg()}
    if with_jax:
        import jax
        info.update(jax=jax.__version__, jax_backend=jax.default_backend(),
                    device=str(jax.devices()[0].device_kind), device_count=jax.device_count())
    for mod in ("torch", "transformers"):
        with contextlib.suppress(ImportError):
            info[mod] = __import__(mod).__version__
    return info


def default_price_per_hour(info: dict) -> tuple[float | None, str]:
    """(USD per hour, its source) for the machine `info` describes: on a CPU the vendor's AWS
    on-demand price per vCPU times the cores this process may use; on an accelerator none is
    assumed (prices differ by provider and commitment by several times)."""
    if (backend := info.get("jax_backend", "cpu")) != "cpu":
        return None, f"no list price assumed for {info.get('device', backend)}: " \
                     "pass --price-per-hour"
    vendor = "amd" if "amd" in (info.get("cpu_model") or "").lower() else "intel"
    per_vcpu, source = CPU_PRICES[vendor]
    cores = int(info.get("cpu_count") or 1)
    return per_vcpu * cores, f"{source} x {cores} vCPU"


def add_price_argument(ap) -> None:
    price, source = default_price_per_hour({"cpu_model": cpu_model(), "cpu_count": cpu_count()})
    ap.add_argument("--price-per-hour", type=float, default=None,
                    help="USD per hour of this machine, for the cost per million output tokens "
                         f"(default on this CPU: ${price:.4f}/h, {source}; on a GPU none is "
                         "assumed)")


def resolve_price(price_per_hour: float | None, info: dict) -> dict:
    """The price a report uses: the one given, or the default for the machine it ran on."""
    price, source = ((price_per_hour, "--price-per-hour") if price_per_hour is not None
                     else default_price_per_hour(info))
    return {"usd_per_hour": price, "source": source}
