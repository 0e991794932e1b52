"""The throughput benchmark's plots: slot occupancy and KV blocks per step, latency CDFs."""
from __future__ import annotations

from pathlib import Path

from jaxbatch.benchmarks.report import cdf, pyplot, save_png
from jaxbatch.benchmarks.workloads import SHORT_KINDS


def plot_all(report, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    files, runs = [], report.get("offline", {}).get("runs", {})
    slots = report["args"]["max_num_seqs"]
    if stepped := {k: r for k, r in runs.items() if r.steps}:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for name, run in stepped.items():
            t = [s[0] for s in run.steps]
            ax1.step(t, [s[1] / slots for s in run.steps], where="post", label=name)
            ax2.step(t, [s[2] for s in run.steps], where="post", label=name)
        ax1.set(ylabel="slot occupancy",
                title=f"Offline workload, {slots} slots: sequences computed per step")
        ax2.set(ylabel="KV blocks in use", xlabel="seconds since start")
        ax1.legend()
        files.append(save_png(fig, out_dir / "occupancy.png"))
    if runs:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, run in runs.items():
            done = [t for t in run.traces if t.token_times]
            cdf(axes[0], [t.token_times[0] - t.arrival for t in done], name)
            cdf(axes[1], [t.token_times[-1] - t.arrival for t in done], name)
        for ax, what in zip(axes, ("TTFT (s)", "end-to-end latency (s)")):
            ax.set(xlabel=what, ylabel="fraction of requests")
            ax.legend()
        fig.suptitle("Offline workload: latency CDFs")
        files.append(save_png(fig, out_dir / "latency_cdf.png"))
    if online := report.get("online", {}).get("runs", {}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, run in online.items():
            cdf(ax, [t.token_times[0] - t.arrival for t in run.traces
                      if t.kind in SHORT_KINDS and t.token_times], name)
        ax.set(xlabel="TTFT of short requests (s)", ylabel="fraction of requests",
               title=f"Online, {report['args']['request_rate']} req/s, long prompts among them")
        ax.legend()
        files.append(save_png(fig, out_dir / "online_ttft_cdf.png"))
    return files
