"""A served request's way to its first token beside the in-process one: each stage's own time and the hops
between, from the phases the stages report with a first output (mmserve/runtime/timeline.py) and the
ingress's round trips (its `Server-Timing` header).

Owns: the derived rows (a stage's work summed, each hop as a round trip less the callee's own time), their
medians and the breakdown table. Does not own the probes (path.py) nor the run (bench_path.py).
"""

from __future__ import annotations

import math
import statistics

DECODER_PHASES = ("decoder.prefix", "decoder.embeddings", "decoder.admit", "decoder.first_output")
HOP_PREPROCESS = "hop: ingress -> Preprocess"
HOP_ENCODER = "hop: Decoder -> Encoder"
HOP_STREAM = "hop: Decoder's stream -> ingress"

ROWS = (  # (phase, label): the table's rows, in the request's order
    ("parse", "ingress: body read and validated"),
    ("preprocess", "ingress: the Preprocess call"),
    ("preprocess.replica", "  in the replica, the whole call"),
    ("preprocess.work", "    the work (its phases summed)"),
    ("preprocess.prompt", "      prompt rendered, tokenized"),
    ("preprocess.image_read", "      image read"),
    ("preprocess.image_decode", "      looked up by bytes, decoded"),
    ("preprocess.image_hash", "      pixels hashed"),
    ("preprocess.image_process", "      looked up by pixels, processed"),
    ("preprocess.image_store", "      kept in the cache"),
    ("preprocess.features", "      features"),
    (HOP_PREPROCESS, "  the hop: call less replica"),
    ("first", "ingress: the Decoder's stream to its first item"),
    ("decoder.prefix", "  prompt hashed, prefix looked up"),
    ("decoder.embeddings", "  embeddings"),
    ("decoder.encode_call", "    the Encoder call"),
    ("encoder.replica", "      in the replica, the whole call"),
    ("encoder.stage", "        in the stage: added -> handed out"),
    ("encoder.pixels", "          pixels read"),
    ("encoder.forward", "          the vision forward"),
    (HOP_ENCODER, "      the hop: call less replica"),
    ("decoder.admit", "  handed to the step thread"),
    ("decoder.first_output", "  scheduled, prefilled, sampled, handed on"),
    (HOP_STREAM, "  the hop: stream less the decoder's phases"),
)


def with_hops(phases: dict[str, float]) -> dict[str, float]:
    """One request's phases (ms) with the derived rows: the preprocess work summed, and each hop whose round trip
    and callee's own time are both there."""
    out = dict(phases)
    work = [ms for name, ms in phases.items() if name.startswith("preprocess.") and name != "preprocess.replica"]
    if work:
        out["preprocess.work"] = sum(work)
    if "preprocess" in phases and "preprocess.replica" in phases:
        out[HOP_PREPROCESS] = phases["preprocess"] - phases["preprocess.replica"]
    if "decoder.encode_call" in phases and "encoder.replica" in phases:
        out[HOP_ENCODER] = phases["decoder.encode_call"] - phases["encoder.replica"]
    if "first" in phases and "decoder.admit" in phases:
        out[HOP_STREAM] = phases["first"] - sum(phases.get(name, 0.0) for name in DECODER_PHASES)
    return out


def medians(requests: list[dict[str, float]]) -> dict[str, float]:
    """Each row's median over the requests that have it (ms); each request's hops derived from its own phases."""
    rows = [with_hops(phases) for phases in requests]
    names = {name for row in rows for name in row}
    return {name: statistics.median(row[name] for row in rows if name in row) for name in names}


def report(kinds: dict[str, dict[str, dict[str, float]]]) -> None:
    """kinds: kind -> {"served": medians, "in_process": medians}; prints served / in process per row."""
    print(f"\nWhere the first token's time goes (ms, medians; served / in process):\n{'':48}"
          + "".join(f"{kind:>20}" for kind in kinds))
    for name, label in ROWS:
        cells = [_cell(k["served"].get(name), k["in_process"].get(name)) for k in kinds.values()]
        if any(cell.strip("- /") for cell in cells):
            print(f"{label:48}" + "".join(f"{cell:>20}" for cell in cells))


def _cell(served: float | None, in_process: float | None) -> str:
    def show(ms: float | None) -> str:
        return "-" if ms is None or math.isnan(ms) else f"{ms:.2f}"

    return f"{show(served)} / {show(in_process)}"
