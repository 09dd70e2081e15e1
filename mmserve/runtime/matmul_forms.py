"""A step's products of activations and weights, `x @ w.T`, in the form this machine runs fastest.

Owns: the equivalent forms of the product (each one library call, same result up to float rounding),
whether weights are stored in oneDNN's packed layout, choosing both by timing them at start-up on the
model's own weights (a form per row count and thread count), the timings themselves (`costs`, which the
layout while serving weighs, `weight_layout.py`, until whole steps are timed, `layout_steps.py`), and the
product itself (`forms.product(x, w)`).
Does not own which threads a step uses (`step_threads.py`), the weights (the model module lays out its
own with `relaid`), nor when to measure (the decoder, on a CPU).

NOTE: why: a decode step reads every weight once, so its products are matrix-vector-like, with the
weights coming from memory, and CPU libraries route such shapes differently. On one CPU
(docs/benchmarks.md) `F.linear` (MKL) at 1-8 rows took several times as long as the same product written
as `mm(w, x.T).T`, one row was faster computed twice (two rows) than once, and oneDNN with packed
weights (what torch.compile's CPU backend emits for a linear layer) was faster still at every row
count, prefill included; another CPU ranked the plain forms differently. Hence a measurement on the
machine, the model and the thread counts at hand.
NOTE: the forms are timed on a cycle of the model's weights in step order, at least `COLD_BYTES` of
them (or all), so that the weights are not in the CPU's caches between uses, as in a step.
NOTE: the oneDNN ops are torch's internal `torch.ops.mkldnn` ones (torch is pinned); where a build
lacks them, packing is simply not a candidate.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, in) x, (out, in) w -> (rows, out)
LINEAR = "linear"
ONEDNN = "onednn"  # the product with a weight packed for oneDNN (a timing key; `pack` stores the weights so)
CLOSE = 0.05  # another form (or packing) must be this much faster than F.linear to be chosen (noise, not a win)
COLD_BYTES = 256 << 20  # NOTE: more than a core complex's last-level cache on today's server CPUs
BIG_TIMING_ROWS = 1024  # products of more rows are timed at this many (bound by arithmetic, not by the weights)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()  # (rows, out), a transposed view


def _doubled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, torch.cat((x, x)).t())[:, :1].t()  # one row as two: (1, out)


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., in) times a weight packed by `MatmulForms.pack` -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")


FORMS: dict[str, Form] = {LINEAR: _linear, "transposed": _transposed, "doubled": _doubled}


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


class MatmulForms:
    """`forms.product(x, w)` = `x @ w.T` for x (rows, in) and w (out, in): by oneDNN if w was
    packed by `pack`, else in the form chosen for x's row count under the thread count set by `use`,
    F.linear where nothing was chosen (the default everywhere). The result may be a non-contiguous view."""

    def __init__(self) -> None:
        self.chosen: dict[int, tuple[str, ...]] = {}  # threads -> form per row count (index = rows)
        self.pack_rows: int | None = None  # weights are packed for steps of about this many rows; None = plain
        self.pack_hint: int | None = None  # the rows oneDNN's packing was timed with; None = it was not a candidate
        # threads -> rows -> (the best plain form's, oneDNN's packed product's) seconds for the timed cycle ...
        self.costs: dict[int, dict[int, tuple[float, float]]] = {}
        self.timed_share = 1.0  # ... which held this share of the weights' bytes
        # re-laying every weight packed (True) or plain again (False) takes about this long (s; timed on the cycle)
        self.relayout_seconds: dict[bool, float] = {True: 0.0, False: 0.0}
        self._ever_packed = False  # NOTE: once weights may be packed, every product checks its weight's layout
        self._forms: tuple[Form, ...] = ()  # the current thread count's forms, index = rows
        self.product: Form = F.linear  # what a call computes with: F.linear, or the dispatch to the chosen forms

    def _chosen(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.is_mkldnn:
            return _onednn(x, w)
        rows, forms = x.shape[0], self._forms
        return forms[rows](x, w) if rows < len(forms) else F.linear(x, w)

    def use(self, threads: int) -> None:
        """The forms for steps run at `threads` torch threads (F.linear if none were measured for it)."""
        names = self.chosen.get(threads, ())
        self._forms = () if all(n == LINEAR for n in names) else tuple(FORMS[n] for n in names)
        # NOTE: a tiny model's step is mostly launch costs: F.linear itself where nothing else was chosen
        self.product = F.linear if not self._forms and not self._ever_packed else self._chosen

    def packing(self, rows: int | None) -> None:
        """Pack weights (`pack`) for steps of about `rows` rows from now on; None = keep them plain."""
        self.pack_rows = rows
        self._ever_packed |= rows is not None
        self.use(torch.get_num_threads())

    def all_plain(self) -> None:
        """Every weight is plain again (a change to plain is done): products stop checking their weight's
        layout."""
        self._ever_packed = False
        self.use(torch.get_num_threads())

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """`w` (out, in) as this machine multiplies it fastest: oneDNN's packed layout if measured so, else itself."""
        return w if self.pack_rows is None else torch.ops.mkldnn._reorder_linear_weight(w, self.pack_rows)

    def relaid(self, w: torch.Tensor) -> torch.Tensor:
        """`w` (out, in) in the layout now chosen (`packing`): packed, or plain again (oneDNN's reorder back
        gives the very same values)."""
        if self.pack_rows is None:
            return w.to_dense() if w.is_mkldnn else w
        return w if w.is_mkldnn else self.pack(w)

    def calibrate(self, weights: Sequence[torch.Tensor], thread_counts: Iterable[int], max_rows: int,
                  big_rows: int, rounds: int = 5) -> None:
        """Choose a plain form for each row count 1..max_rows at each thread count, and whether to pack the
        weights (`pack_rows`): when oneDNN's product is faster by CLOSE in the geometric mean over those row
        counts and `big_rows` (a prefill chunk) at every count. Times products with a cycle of `weights` (in
        step order); leaves torch's thread count as it found it."""
        if any(w.is_mkldnn for w in weights):
            raise ValueError("the forms are timed on plain weights; these are packed")
        cycle = _cold_cycle(weights)
        self.costs, self.timed_share = {}, _bytes(cycle) / _bytes(weights)
        packed, self.relayout_seconds = _packed_timed(cycle, big_rows, self.timed_share)
        self.pack_hint = big_rows if packed is not None else None
        ratios: list[float] = []
        before = torch.get_num_threads()
        try:
            for threads in sorted(set(thread_counts)):
                torch.set_num_threads(threads)
                names = [LINEAR]
                for rows in [*range(1, max_rows + 1), *([big_rows] if big_rows > max_rows else [])]:
                    medians = _timings(cycle, packed, rows, rounds)
                    plain = {name: t for name, t in medians.items() if name != ONEDNN}
                    best = min(plain, key=plain.__getitem__)
                    if rows <= max_rows:
                        names.append(LINEAR if plain[LINEAR] <= plain[best] * (1 + CLOSE) else best)
                    if ONEDNN in medians:
                        ratios.append(medians[ONEDNN] / plain[best])
                        self.costs.setdefault(threads, {})[rows] = (plain[best], medians[ONEDNN])
                self.chosen[threads] = tuple(names)
                if max_rows:
                    log.info("matmul forms at %d threads, by rows 1..%d: %s", threads, max_rows,
                             ", ".join(names[1:]))
        finally:
            torch.set_num_threads(before)
        gain = statistics.geometric_mean(ratios) if ratios else 1.0
        self.packing(big_rows if gain < 1 - CLOSE else None)
        log.info("weights %s: oneDNN's product took %.2fx the best plain form's (geometric mean)",
                 "packed for oneDNN" if self.pack_rows else "kept plain", gain)


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose weight oneDNN holds packed (`MatmulForms.pack`): the same product and bias up to
    float rounding (NOTE: another summation order: not bit-equal at real sizes, e.g. SigLIP's 1152-wide layers
    differ by ~1e-5; within the parity tolerance, and greedy tokens may differ only at near-ties)."""

    def __init__(self, linear: torch.nn.Linear, forms: MatmulForms) -> None:
        super().__init__()
        self.weight = forms.pack(linear.weight.detach())  # (out, in), oneDNN's layout
        self.bias = None if linear.bias is None else linear.bias.detach()  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


def pack_linears(module: torch.nn.Module, rows: int, rounds: int = 2) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear` where oneDNN's product with packed weights
    is measured faster (CLOSE) than F.linear at `rows` rows (at most BIG_TIMING_ROWS), on one weight of each
    shape; -> how many.
    NOTE: products of many rows are bound by arithmetic, not by reading the weights: no cold cycle needed."""
    linears = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if isinstance(child, torch.nn.Linear)]
    if not linears or not onednn_packing_available():
        return 0
    forms = MatmulForms()
    shapes = {tuple(child.weight.shape): child.weight.detach() for _, _, child in linears}
    forms.calibrate(list(shapes.values()), {torch.get_num_threads()}, 0, min(rows, BIG_TIMING_ROWS), rounds)
    if forms.pack_rows is None:
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, forms))
    return len(linears)


def _packed(weights: list[torch.Tensor], rows: int) -> list[torch.Tensor] | None:
    """The weights packed for oneDNN, or None where it cannot pack them (no such ops; a dtype this CPU's
    oneDNN lacks, e.g. float16 without AVX-512 FP16)."""
    if not onednn_packing_available():
        return None
    try:
        return [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    except RuntimeError as exc:
        log.info("oneDNN cannot pack %s weights here (%s): kept plain", weights[0].dtype, exc)
        return None


def _packed_timed(cycle: list[torch.Tensor], rows: int,
                  share: float) -> tuple[list[torch.Tensor] | None, dict[bool, float]]:
    """`_packed(cycle, rows)`, and how long re-laying every weight takes each way (s): the cycle's packing and
    unpacking, over its `share` of the bytes, after one weight of each untimed (oneDNN's own set-up)."""
    first = _packed(cycle[:1], rows)
    if first is None:
        return None, {True: 0.0, False: 0.0}
    first[0].to_dense()
    started = time.perf_counter()
    packed = _packed(cycle, rows)
    middle = time.perf_counter()
    for w in packed or ():
        w.to_dense()
    return packed, {True: (middle - started) / share, False: (time.perf_counter() - middle) / share}


def _bytes(weights: Sequence[torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights)


def _cold_cycle(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The first weights in step order that add up to `COLD_BYTES`, or all of them."""
    cycle, total = [], 0
    for w in weights:
        cycle.append(w)
        total += w.numel() * w.element_size()
        if total >= COLD_BYTES:
            break
    return cycle


def _timings(cycle: list[torch.Tensor], packed: list[torch.Tensor] | None, rows: int,
             rounds: int) -> dict[str, float]:
    """Median seconds of the products of `rows` rows with every weight of the cycle, per form (and packed).
    Forms are timed in interleaved rounds (a warm-up first), so that the machine's drift falls on all alike."""
    names = [LINEAR, "transposed"] + (["doubled"] if rows == 1 else []) + ([ONEDNN] if packed else [])
    w0 = cycle[0]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w0.dtype, device=w0.device) for w in cycle}
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1 + rounds):
        for name in names:
            started = time.perf_counter()
            if name == ONEDNN:
                assert packed is not None
                for w, p in zip(cycle, packed, strict=True):
                    _onednn(xs[w.shape[1]], p)
            else:
                form = FORMS[name]
                for w in cycle:
                    form(xs[w.shape[1]], w)
            if round_:
                timings[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in timings.items()}
