"""One cell's figures from its per-request results: rates, percentiles, token counts.

Owns the definitions: requests/s and output tokens/s over the cell's wall time (first send to last
end, successful requests only), TTFT and end-to-end latency percentiles, time per output token after
the first. Output tokens are what each server reported, so systems that stop early are normalised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench_lib.loadgen import CellRun


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: CellRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tokens = [r.output_tokens for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1]
    wall = run.wall_s
    return {
        "requests": len(run.results),
        "ok": len(ok),
        "errors": sorted({r.error for r in run.results if not r.ok and r.error})[:3],
        "wall_s": wall,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "out_tok_per_s": sum(tokens) / wall if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "tpot_p50_ms": (pct(tpot, 50) or 0) * 1e3 if tpot else None,
        "output_tokens_min": min(tokens) if tokens else None,
        "output_tokens_max": max(tokens) if tokens else None,
        "prompt_tokens_mean": (float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None]))
                               if any(r.prompt_tokens is not None for r in ok) else None),
        "ttft_s_all": ttft,
        "ttft_p50_s_by_turn": _by_turn(ok),
    }


def _by_turn(ok: list) -> dict[str, float]:
    """TTFT p50 per chat turn, for keys ending in /t<turn> (the multiturn workload); {} otherwise."""
    turns: dict[str, list[float]] = {}
    for r in ok:
        tail = r.key.rsplit("/", 1)[-1]
        if tail.startswith("t") and tail[1:].isdigit() and r.ttft_s is not None:
            turns.setdefault(tail, []).append(r.ttft_s)
    return {t: float(np.percentile(v, 50)) for t, v in sorted(turns.items())}


def median_dicts(rows: list[dict[str, float] | None]) -> dict[str, float]:
    """Key-wise medians over dicts with the same keys (None rows skipped)."""
    found = [r for r in rows if r]
    if not found:
        return {}
    return {"requests": len(found), **{k: float(np.median([r[k] for r in found])) for k in found[0]}}
