"""PNG figures of a run: throughput vs concurrency, TTFT distributions (CDFs) per workload, and where
mmserve's time to first token goes (stacked medians per cell, from profile.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLOURS = {"mmserve": "tab:blue", "transformers": "tab:orange", "generate": "tab:green", "engine": "tab:purple"}
# NOTE: variants ("mmserve+OMP_NUM_THREADS=2") get matplotlib's next colour (COLOURS.get -> None)


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
        ax.set_ylim(bottom=0)
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


def ttft_breakdown(profile: dict, out: Path) -> Path | None:
    """Stacked bars of mmserve's TTFT components (medians, ms) per probe kind and cell."""
    from bench_lib.raylogs import COMPONENTS

    rows = {k.removeprefix("mmserve "): v for k, v in profile.items()
            if k.startswith("mmserve ") and isinstance(v, dict) and v}
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows)), 4.2))
    bottom = [0.0] * len(rows)
    for part in COMPONENTS:
        values = [max(0.0, row.get(part, 0.0)) for row in rows.values()]
        ax.bar(list(rows), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms (median of each component)")
    ax.set_title("mmserve: where the time to first token goes")
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "mmserve_ttft_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
