"""PNG figures of a run: throughput vs concurrency, and TTFT distributions (CDFs) per workload."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLOURS = {"mmserve": "tab:blue", "transformers": "tab:orange", "generate": "tab:green", "engine": "tab:purple"}


def throughput(results: dict, out: Path) -> Path:
    workloads = list(results)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for system, by_c in results[workload].items():
            cs = sorted(by_c)
            ax.plot(cs, [by_c[c].get("req_per_s") or 0 for c in cs], "o-", label=system, color=COLOURS.get(system))
        ax.set_title(workload)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("requests/s")
        ax.set_xticks(sorted({c for by_c in results[workload].values() for c in by_c}))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    path = out / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(results: dict, out: Path) -> Path:
    workloads = list(results)
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for system, by_c in results[workload].items():
            for k, c in enumerate(sorted(by_c)):
                ttft = sorted(by_c[c].get("ttft_s_all") or [])
                if ttft:
                    ys = [0.0] + [(i + 1) / len(ttft) for i in range(len(ttft))]
                    ax.step([ttft[0], *ttft], ys, where="post", linestyle=styles[k % len(styles)],
                            color=COLOURS.get(system), label=f"{system} c={c}")
        ax.set_xscale("log")
        ax.set_title(f"{workload}: TTFT CDF")
        ax.set_xlabel("time to first token (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path = out / "ttft_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
