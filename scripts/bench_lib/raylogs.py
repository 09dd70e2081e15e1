"""Where an mmserve request's time to first token goes, from Ray Serve's own replica access logs.

Every replica logs each call with the HTTP request's id (the benchmark sets it with `x-request-id`),
its end time and its duration, e.g.
  INFO 2026-11-30 09:56:16,799 mmserve_Encoder nmfhkwko bench-unique-c8-3 -- CALL encode OK 1016.5ms
so a request's calls line up with the client's send and first-token times: no engine change needed.

Owns: parsing those lines and splitting each request's TTFT into
  ingress      client send -> Preprocess.process starts (HTTP proxy, ingress body parse, handle hop)
  preprocess   Preprocess.process (image decode, hash, processor-cache lookup, HF processor, ray.put)
  pre->dec     Preprocess returns -> Decoder.generate starts (handle hops through the ingress)
  dec->enc     Decoder.generate starts -> Encoder.encode starts (handle hop)
  encoder      Encoder.encode (wait for the encoder step + vision forward)
  after enc    Encoder.encode ends -> first content chunk at the client (embeddings back through the
               object store, decoder wait for its step, prefill, first chunk back through ingress + proxy)
For text-only requests "after enc" runs from the decoder's start.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

_LINE = re.compile(
    r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) mmserve_(\w+) \w+ (\S+) -- "
    r"(?:CALL (\w+) \w+|(POST) \S+ \d+) ([\d.]+)ms")

COMPONENTS = ("ingress", "preprocess", "pre->dec", "dec->enc", "encoder", "after_enc")


def parse_serve_logs(log_dir: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """request id -> 'Deployment.method' -> [(start epoch s, end epoch s)]."""
    calls: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(log_dir.glob("replica_mmserve_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            stamp, deployment, rid, method, post, ms = m.groups()
            end = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            calls[rid][f"{deployment}.{method or post}"].append((end - float(ms) / 1e3, end))
    return calls


def breakdown(calls: dict[str, list[tuple[float, float]]], sent: float, first: float) -> dict[str, float] | None:
    """One request's TTFT split (ms); None when its preprocess or decoder call is missing."""
    pre = calls.get("Preprocess.process")
    dec = calls.get("Decoder.generate")
    if not pre or not dec:
        return None
    (p0, p1), (d0, _) = pre[0], dec[0]
    enc = calls.get("Encoder.encode")
    out = {"ingress": p0 - sent, "preprocess": p1 - p0, "pre->dec": d0 - p1}
    if enc:
        e0, e1 = enc[0]
        out.update({"dec->enc": e0 - d0, "encoder": e1 - e0, "after_enc": first - e1})
    else:
        out.update({"dec->enc": 0.0, "encoder": 0.0, "after_enc": first - d0})
    out["ttft"] = first - sent
    return {k: v * 1e3 for k, v in out.items()}


def median_breakdown(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Component medians over requests (ms); medians need not add up to the TTFT median."""
    if not rows:
        return {}
    return {"requests": len(rows), **{k: statistics.median(r[k] for r in rows) for k in (*COMPONENTS, "ttft")}}
