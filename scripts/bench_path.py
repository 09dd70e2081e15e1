"""Where a single client's time goes: the tiny model served through HTTP and the deployments, against the
in-process Engine and Serve's own floor (a no-op app shaped like ours), all in one run on one Ray, the three
sampled in turn rep by rep so that the machine's drift falls on all alike.

Prints, for a text request, a new image and the same image again: time to first token in process and
served, the difference, Serve's floor for the hops that path takes (the no-op app carrying that request's
own body; the floor with an 8-byte body beside it), and what is left above it; where the
first token's time goes, served beside in process: each stage's own phases (reported with the first
output) and each hop, a round trip less the callee's own time (bench_lib/timeline.py); and the cost per
streamed token.

  python scripts/bench_path.py                  # ~3 min on 2 cores
  python scripts/bench_path.py --reps 40
  python scripts/bench_path.py --app ingress.env='{"GOMP_SPINCOUNT": "10000"}'   # an app argument changed
  python scripts/bench_path.py --idle-tax-rounds 0                                # without the idle-tax probe

Last, the idle-tax probe times the same in-process work (a new image's first token, a stream's tokens) with
Serve's processes running idle and with them stopped, alternated (bench_lib/idle_tax.py), and counts how
often each of them wakes while idle: what the served path pays on a small node before any hop.
Results: bench-results/path-<timestamp>.json and the table printed at the end.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_lib import timeline  # noqa: E402
from bench_lib.allocator import malloc_as_replicas  # noqa: E402
from bench_lib.idle_tax import idle_tax, serve_processes, wakeups_per_s  # noqa: E402
from bench_lib.path import (  # noqa: E402
    STREAM_TOKENS,
    Client,
    ServeFloor,
    Timed,
    chat_body,
    image_url,
    in_process,
    messages,
    served,
)
from bench_lib.procs import machine_cpu_s  # noqa: E402
from bench_lib.report import write_results  # noqa: E402

# NOTE: 2 ms above Serve's floor for text, 5 ms for an image; 0.3 ms per token (issue 17)
TARGETS = {"text": 2.0, "new image": 5.0, "repeated image": 5.0, "per token": 0.3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, app_args: dict[str, str]) -> None:
    import ray
    from bench_lib.noop_app import noop_app
    from ray import serve

    from deployments.app import build_app, cluster_env_started_here

    cluster_env_started_here()  # as `serve run` gets it: the app is built before Ray starts
    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR,
             runtime_env={"env_vars": {"PYTHONPATH": f"{HERE}:{HERE.parent}"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(noop_app(), name="noop", route_prefix="/noop")
    serve.run(build_app(dict(app_args)), name="default", route_prefix="/")


def probes(engine: Any, client: Client, reps: int, floor: ServeFloor, first: int = 0
           ) -> dict[str, list[tuple[Timed, Timed]]]:
    """kind -> [(in process, served)], interleaved rep by rep, each rep also sampling Serve's floor into
    `floor`; reps numbered from `first` (a number picks the rep's texts and image: each a new one).

    NOTE: the order turns every rep (in process first, then served first; the floor before, then after), so
    that what one leaves behind (a replica's OpenMP spin, the collector) falls on each side alike."""
    out: dict[str, list[tuple[Timed, Timed]]] = {"text": [], "new image": [], "repeated image": []}
    for i in range(first, first + reps):
        text = messages(f"Tell me about the sea, number {i}.", None)
        url = image_url(10_000 + i)
        fresh, again = messages("What is in this picture?", url), messages(f"And now {i}?", url)
        kinds = (("text", text), ("new image", fresh), ("repeated image", again))
        if i % 2 == 0:
            floor.sample(client, {kind: chat_body(msgs, 1) for kind, msgs in kinds})
        for kind, msgs in kinds:
            out[kind].append(pair(functools.partial(in_process, engine, msgs, 1),
                                  functools.partial(served, client, msgs, 1), i))
        if i % 2:
            floor.sample(client, {kind: chat_body(msgs, 1) for kind, msgs in kinds})
    return out


def pair(here: Callable[[], Timed], there: Callable[[], Timed], rep: int) -> tuple[Timed, Timed]:
    """(in process, served), the one run first turning with `rep`."""
    if rep % 2 == 0:
        first = here()
        return first, there()
    first = there()
    return here(), first


def _sigterm(*_: Any) -> None:
    raise SystemExit("SIGTERM")  # NOTE: unwinds through the idle-tax probe's resume of Serve's processes


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--idle-tax-rounds", type=int, default=6, help="rounds of the idle-tax probe (0: none)")
    ap.add_argument("--app", action="append", default=[], metavar="KEY=VALUE",
                    help="an app argument as `serve run` takes it, e.g. decoder.embedding_cache_bytes=0 (repeatable)")
    args = ap.parse_args(argv)
    # NOTE: the in-process Engine under the replicas' malloc settings, set before any thread (allocator.py)
    print(f"this process's malloc as the replicas': {malloc_as_replicas()}")
    from deployments.args import parse_args
    from mmserve.engine import Engine

    port = free_port()
    app_args = {"ingress.stage_timing": "true", **dict(item.split("=", 1) for item in args.app)}  # the stages' phases
    start(port, app_args)
    engine = Engine(parse_args(dict(app_args)).engine_config())  # the app's own engine config, in this process
    client = Client(port)
    for k in range(3):  # warm-up: every stage's first forward pays torch's one-time costs (the no-op app too)
        probes(engine, client, 1, ServeFloor(), first=5_000 + k)  # NOTE: images the timed reps never send
    floor = ServeFloor()
    start_s, (_, steal_s) = time.monotonic(), machine_cpu_s()
    runs = probes(engine, client, args.reps, floor)
    long = messages("Write a long story.", None)
    streams = [pair(lambda: in_process(engine, long, STREAM_TOKENS), lambda: served(client, long, STREAM_TOKENS), k)
               for k in range(max(args.reps, 3))]
    repeats_encode = engine.config.decoder.embedding_cache_bytes == 0
    results = {**summarize(floor.summary(), runs, streams, repeats_encode), "app_args": app_args,
               "steal_cores": (machine_cpu_s()[1] - steal_s) / (time.monotonic() - start_s)}
    if args.idle_tax_rounds:
        results["idle_tax"] = measure_idle_tax(engine, args.idle_tax_rounds)
    report(results)
    write_results(results, args.out, "path")
    engine.shutdown()


def measure_idle_tax(engine: Any, rounds: int) -> dict[str, Any]:
    """Serve's processes' wakes per second while idle, and what they cost the in-process engine's work."""
    procs = serve_processes()
    seeds = iter(range(30_000, 40_000))
    long = messages("Write a long story.", None)

    def new_image() -> float:
        return in_process(engine, messages("What is in this picture?", image_url(next(seeds))), 1).ttft_ms

    def per_token() -> float:
        ms = in_process(engine, long, 16).per_token_ms
        if ms is None:
            raise RuntimeError("a 16-token stream gave no per-token time")
        return ms

    wakes = wakeups_per_s(procs)
    return {"processes": len(procs), "wakeups_per_s": wakes, "wakeups_per_s_total": sum(wakes.values()),
            "new_image_ttft": idle_tax(new_image, procs, rounds), "per_token": idle_tax(per_token, procs, rounds)}


def summarize(floor: dict[str, Any], runs: dict[str, list[tuple[Timed, Timed]]],
              streams: list[tuple[Timed, Timed]], repeats_encode: bool = False) -> dict[str, Any]:
    """The report's figures; `repeats_encode`: a repeated image's path takes the Decoder -> Encoder hop (the
    Decoder's embedding cache is off)."""
    m = statistics.median
    kinds = {}
    for kind, rows in runs.items():
        ours, theirs = m(r[0].ttft_ms for r in rows), m(r[1].ttft_ms for r in rows)
        # NOTE: a new image adds the Decoder -> Encoder hop; a repeated one's rows past the cached prefix come
        # from the Decoder's own embedding cache (mmserve/decoder/embedding_cache.py) unless it is off
        encodes = kind == "new image" or (kind == "repeated image" and repeats_encode)
        extra = floor["handle_hop"] if encodes else 0.0
        # NOTE: Serve's floor for the path carries the request's own body (an image's data URL: ~330 KB
        # through the proxy, the ingress's JSON and the hop to Preprocess); the small-body floor beside it
        hops, small = floor["path_with_body"][kind] + extra, floor["text_path"] + extra
        kinds[kind] = {"in_process_ttft_ms": ours, "served_ttft_ms": theirs, "overhead_ms": theirs - ours,
                       "serve_floor_ms": hops, "above_floor_ms": theirs - ours - hops,
                       "small_body_floor_ms": small, "above_small_body_floor_ms": theirs - ours - small,
                       "phases_ms": timeline.medians([r[1].phases for r in rows]),
                       "in_process_phases_ms": timeline.medians([r[0].phases for r in rows])}
    pairs = [(a.per_token_ms, b.per_token_ms) for a, b in streams
             if a.per_token_ms is not None and b.per_token_ms is not None]
    # NOTE: the overhead is the median of each pair's difference (the two streams ran back to back, so the
    # machine's drift falls on both), not the difference of the two medians (kept beside it)
    return {"serve_floor_ms": floor, "ttft": kinds,
            "per_token_ms": {"in_process": m(p[0] for p in pairs), "served": m(p[1] for p in pairs),
                             "overhead": m(b - a for a, b in pairs),
                             "medians_difference": m(p[1] for p in pairs) - m(p[0] for p in pairs)}}


def report(r: dict[str, Any]) -> None:
    f = r["serve_floor_ms"]
    print(f"\nServe's floor (no-op app): proxy -> ingress {f['proxy_to_ingress']:.2f} ms, handle hop "
          f"+{f['handle_hop']:.2f}, streamed hop's first item +{f['streamed_hop_first']:.2f}, each further item "
          f"{f['streamed_item']:.3f}")
    print("floor: the no-op app's path with the request's own body (plus a handle hop where the path encodes);"
          " small: the same with an 8-byte body")
    print(f"{'':16}{'in-process':>11}{'served':>9}{'overhead':>10}{'floor':>8}{'above':>8}{'small':>8}{'above':>8}"
          "   phases (parse/preprocess/first)")
    for kind, k in r["ttft"].items():
        p = {name: k["phases_ms"].get(name, float("nan")) for name in ("parse", "preprocess", "first")}
        ok = "PASS" if k["above_floor_ms"] <= TARGETS[kind] else "FAIL"
        print(f"{kind:16}{k['in_process_ttft_ms']:11.2f}{k['served_ttft_ms']:9.2f}{k['overhead_ms']:10.2f}"
              f"{k['serve_floor_ms']:8.2f}{k['above_floor_ms']:8.2f}{k['small_body_floor_ms']:8.2f}"
              f"{k['above_small_body_floor_ms']:8.2f}   {p['parse']:.2f}/{p['preprocess']:.2f}/"
              f"{p['first']:.2f}  (<= +{TARGETS[kind]} ms: {ok})")
    timeline.report({kind: {"served": k["phases_ms"], "in_process": k["in_process_phases_ms"]}
                     for kind, k in r["ttft"].items()})
    pt = r["per_token_ms"]
    ok = "PASS" if pt["overhead"] <= TARGETS["per token"] else "FAIL"
    print(f"per streamed token: in-process {pt['in_process']:.3f} ms, served {pt['served']:.3f}, overhead "
          f"{pt['overhead']:.3f} (median of the paired differences; of the medians {pt['medians_difference']:.3f}) "
          f"(<= {TARGETS['per token']}: {ok})")
    print(f"the host's steal over the timed reps: {r['steal_cores']:.2f} cores (of {os.cpu_count()}; above 0, "
          "the hypervisor held this machine's processes back, on either side of a pair)")
    tax = r.get("idle_tax")
    if tax:
        print(f"Serve's idle tax: its {tax['processes']} processes wake {tax['wakeups_per_s_total']:.0f} times a "
              "second while idle; the in-process work with them running / stopped:")
        for name in ("new_image_ttft", "per_token"):
            t = tax[name]
            print(f"  {name:16}{t['running_ms']:9.2f} /{t['stopped_ms']:9.2f} ms (medians), rounds' ratios' median "
                  f"{t['ratio']:.3f}x")


if __name__ == "__main__":
    main()
