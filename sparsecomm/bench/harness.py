"""Benchmark harness: timing, checking and reporting, shared by every benchmark.

In the spirit of nccl-tests: a benchmark file only says how to make inputs,
what to run, how many bytes that moves and how to check the result; the
harness warms up, times (interleaving the contenders of one row so that noise
on this shared machine hits them alike), checks every result before it
reports a time (the ``#wrong`` column), and prints/saves the table.

What a person sees, and the API for it:

- :func:`progress` prints one line per configuration on stderr while the
  benchmark runs (stdout keeps only the tables, for pipes and files);
- :func:`print_table` prints every column by default (what ``kernels`` uses),
  or, given ``compact_cols``, only those columns plus a legend of what they
  mean, unless ``wide=True`` (the benchmarks' ``--wide``); JSON and CSV
  always hold every column;
- :func:`check_outputs` checks, before any work, that ``--plot`` can be drawn
  (matplotlib) and that output folders exist: a missing dependency fails in
  the first second with the reason, not after the run.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["DTYPES", "Contender", "Row", "Stopwatch", "time_interleaved", "print_table", "write_outputs",
           "parse_size", "format_size", "plot_rows", "progress", "check_outputs", "EXIT_USAGE", "Verdict"]

EXIT_USAGE = 2  # a missing dependency or a bad option: nothing ran (argparse's own status)
# Columns a compact table always keeps when a row has them: a failure or a skip is never hidden.
_ALWAYS_SHOWN = ("skipped", "error")
_T0 = time.monotonic()

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


@dataclass
class Contender:
    """One implementation in a side-by-side comparison.

    Attributes:
        name: column label.
        run: ``run() -> result``; called repeatedly on the same inputs.
        check: ``check(result) -> int`` number of wrong elements (0 = correct).
    """

    name: str
    run: Callable[[], Any]
    check: Callable[[Any], int] = lambda _: 0


@dataclass
class Row:
    """One line of a report: free-form columns in insertion order."""

    cols: Dict[str, Any] = field(default_factory=dict)


def _sync(device: Optional[str]) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Stopwatch:
    """Seconds between :meth:`start` and :meth:`stop`: CUDA events on GPU, ``perf_counter`` on CPU.

    On GPU the events are recorded on the current stream, so the time is the
    device's time for the work queued in between (nccl-tests does the same);
    :meth:`stop` waits for it.
    """

    def __init__(self, device: Optional[str] = None) -> None:
        self.cuda = device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda")
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._begin.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


def parse_size(text: str) -> int:
    """Parse a byte count like nccl-tests does: ``8``, ``64K``, ``256M``, ``1G`` (powers of 1024)."""
    t = str(text).strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    if unit not in _SIZE_UNITS or not num:
        raise ValueError(f"not a size: {text!r} (use e.g. 8, 64K, 256M, 1G)")
    return int(float(num) * _SIZE_UNITS[unit])


def format_size(nbytes: float) -> str:
    """Bytes as a short label: 8B, 64KB, 256MB."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g}{unit}"
    return f"{nbytes:g}B"


def time_interleaved(contenders: Sequence[Contender], warmup: int = 2, iters: int = 7,
                     device: Optional[str] = None, sync: Callable[[], None] = lambda: None
                     ) -> Dict[str, Dict[str, float]]:
    """Time contenders round-robin; return per-contender median/min/max seconds and #wrong.

    Each contender's result is checked once after warm-up; a contender that
    raises is reported with ``wrong = -1`` and no time.

    Args:
        contenders: the implementations to compare.
        warmup: untimed calls of each before timing.
        iters: timed rounds; each round calls every contender once.
        device: "cuda" to synchronize the device around each call.
        sync: extra synchronization around each call (e.g. a barrier).

    Returns:
        ``{name: {"median": s, "min": s, "max": s, "wrong": n}}``.
    """
    out: Dict[str, Dict[str, float]] = {}
    live: List[Contender] = []
    for c in contenders:
        try:
            result = None
            for _ in range(max(1, warmup)):
                result = c.run()
            _sync(device)
            out[c.name] = {"wrong": float(c.check(result))}
            live.append(c)
        except Exception as exc:  # report, don't abort the whole table
            out[c.name] = {"wrong": -1.0, "error": str(exc)[:200]}
    times: Dict[str, List[float]] = {c.name: [] for c in live}
    for _ in range(iters):
        for c in live:
            sync()
            _sync(device)
            t0 = time.perf_counter()
            c.run()
            _sync(device)
            sync()
            times[c.name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        out[name].update(median=statistics.median(ts), min=min(ts), max=max(ts))
    return out


def _rotated(names: List[str], k: int) -> List[str]:
    """``names`` starting from the ``k``-th (mod its length), the ones before it last."""
    return names[k % len(names):] + names[:k % len(names)]


def interleaved_schedule(names: List[str], warmup: int, steps: int, block: int
                         ) -> List[Tuple[str, int, bool, bool]]:
    """``(method, step, timed, first of a block)`` in the order they run.

    The ``warmup`` untimed steps go one method at a time; then blocks of
    ``block`` consecutive steps of one method each, every method in turn. Each
    round of steps starts from the next method: one stepping right after
    plain DDP would always find the link still draining DDP's bytes (a tbf
    queue at 1 Gbit/s), a bias the rotation spreads over all. With
    ``block`` > 1 a block's first step is not timed (it finds the caches and
    the link as the last method left them) and its others run back to back,
    as a training job runs them: what a method overlaps from one step into the
    next (a pushed gradient, the next step's lookup) counts. Every method
    takes the same steps, so the same batches.
    """
    out = [(m, step, False, True) for step in range(warmup) for m in _rotated(names, step)]
    per = block - 1 if block > 1 else 1
    for k in range(-(-steps // per)):
        first = warmup + k * block
        out += [(m, first + j, block == 1 or j > 0, j == 0) for m in _rotated(names, warmup + k)
                for j in range(block)]
    return out


def progress(msg: str) -> None:
    """Print one progress line on stderr, flushed, with the seconds since this process started benchmarking.

    Benchmarks call it once per configuration (a density, a size, a method's
    check), so a long run is never silent; stdout keeps only the tables.

    Example::

        progress("sparse_sync world 4: zipf(1.1) density 0.001 (2/4) done in 3.1 s")
        # [   7.4s] sparse_sync world 4: zipf(1.1) density 0.001 (2/4) done in 3.1 s
    """
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def check_outputs(plot: Optional[str] = None, json_path: Optional[str] = None,
                  csv_path: Optional[str] = None) -> List[str]:
    """Problems that would make the outputs fail after the run, found before it.

    Args:
        plot: the ``--plot`` path: needs matplotlib.
        json_path, csv_path: ``--json`` / ``--csv`` paths: their folder must exist.

    Returns:
        One message per problem, with its fix; empty when all is well.
    """
    problems = []
    if plot and importlib.util.find_spec("matplotlib") is None:
        problems.append("--plot needs matplotlib, which is not installed: "
                        "pip install 'sparsecomm[bench]' (or pip install matplotlib), or leave out --plot")
    for flag, path in (("--plot", plot), ("--json", json_path), ("--csv", csv_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            problems.append(f"{flag} {path}: folder {folder} does not exist")
    return problems


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:.2f}"
    return str(v)


def print_table(rows: Sequence[Row], title: str = "", compact_cols: Optional[Sequence[str]] = None,
                wide: bool = False, legend: Optional[Dict[str, str]] = None) -> str:
    """Print rows as an aligned text table on stdout (and return the text).

    Args:
        rows: the rows; a column missing from a row prints empty.
        title: printed first, after ``# ``.
        compact_cols: the columns to show by default, in this order (those no
            row has are left out; ``skipped`` and ``error`` are always shown
            when a row has them). None: every column, as before.
        wide: show every column even when ``compact_cols`` is given.
        legend: ``{column: meaning}``; under a compact table, one line per
            shown column that has an entry, then how to see the rest.

    Returns:
        The printed text.
    """
    if not rows:
        return ""
    headers: List[str] = []
    for r in rows:
        for k in r.cols:
            if k not in headers:
                headers.append(k)
    hidden = 0
    if compact_cols is not None and not wide:
        shown = [h for h in compact_cols if h in headers]
        shown += [h for h in _ALWAYS_SHOWN if h in headers and h not in shown]
        hidden = len(headers) - len(shown)
        headers = shown
    cells = [[_fmt(r.cols.get(h, "")) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"# {title}")
    # Numbers align right; a free-text column (why a method failed or was skipped) aligns left,
    # and no line carries trailing blanks: one long reason does not widen every row.
    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if h in _ALWAYS_SHOWN else v.rjust(w)
                         for h, v, w in zip(headers, values, widths)).rstrip()

    lines.append(line(headers))
    lines.extend(line(c) for c in cells)
    if compact_cols is not None and not wide:
        for h in headers:
            if legend and h in legend:
                lines.append(f"#   {h}: {legend[h]}")
        if hidden:
            lines.append(f"#   ({hidden} more columns: --wide prints them all; --json/--csv save them all)")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_outputs(rows: Sequence[Row], json_path: Optional[str] = None, csv_path: Optional[str] = None) -> None:
    """Save rows as JSON and/or CSV."""
    data = [r.cols for r in rows]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1, default=str)
    if csv_path and data:
        keys: List[str] = []
        for d in data:
            keys += [k for k in d if k not in keys]
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(data)


def plot_rows(rows: Sequence[Row], path: str, x: str, y: str, series: str, panel: Optional[str] = None,
              logx: bool = True, logy: bool = True, xlabel: Optional[str] = None, ylabel: Optional[str] = None,
              title: str = "") -> None:
    """Plot column ``y`` against ``x``, one line per value of ``series``, one subplot per value of ``panel``.

    Rows whose ``x`` or ``y`` is not a positive number (an error, a skipped
    method) are left out. Needs matplotlib (``pip install 'sparsecomm[bench]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'sparsecomm[bench]' ({exc})") from exc

    def num(v: Any) -> Optional[float]:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    panels: List[Any] = []
    for r in rows:
        key = r.cols.get(panel) if panel else None
        if key not in panels:
            panels.append(key)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        names: List[Any] = []
        for r in rows:
            if (not panel or r.cols.get(panel) == key) and r.cols.get(series) not in names:
                names.append(r.cols.get(series))
        for name in names:
            pts = sorted((num(r.cols.get(x)), num(r.cols.get(y))) for r in rows
                         if r.cols.get(series) == name and (not panel or r.cols.get(panel) == key)
                         and num(r.cols.get(x)) and num(r.cols.get(y)))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name))
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        ax.grid(True, which="both", alpha=0.3)
        label = "" if not panel else str(key) if isinstance(key, str) else f"{panel}={key}"
        ax.set_title(f"{title}{' - ' if title and label else ''}{label}", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Verdict:
    """How to judge a benchmark's rows in one line: the fastest of ours against the best peer, per configuration.

    Attributes:
        time: the column to compare (lower is faster).
        peers: methods of other systems (the rest are ours).
        config: columns that identify one configuration (rows sharing them compete).
        method: the column naming the contender.
        apart: methods of ours left out of the verdict (not exact: a lossy option).
    """

    time: str
    peers: Sequence[str]
    config: Sequence[str]
    method: str = "method"
    apart: Sequence[str] = ()   # ours, but not exact (lossy options): shown, never the verdict's pick

    def line(self, rows: Sequence[Row]) -> str:
        """``verdict: ...`` naming the most often fastest of ours and its speed-up over the best peer (range, median)."""
        groups: Dict[tuple, List[Row]] = {}
        for r in rows:
            if isinstance(r.cols.get(self.time), (int, float)) and r.cols[self.time] > 0:
                groups.setdefault(tuple(r.cols.get(c) for c in self.config), []).append(r)
        wins: Dict[str, int] = {}
        ratios: List[float] = []
        for group in groups.values():
            ours = [r for r in group if r.cols[self.method] not in self.peers and r.cols[self.method] not in self.apart]
            peers = [r for r in group if r.cols[self.method] in self.peers]
            if not ours or not peers:
                continue
            best = min(ours, key=lambda r: r.cols[self.time])
            wins[best.cols[self.method]] = wins.get(best.cols[self.method], 0) + 1
            ratios.append(min(r.cols[self.time] for r in peers) / best.cols[self.time])
        if not ratios:
            return "verdict: no configuration had both one of ours and a peer to compare"
        top = max(wins, key=wins.get)
        return (f"verdict: fastest of ours: {top} ({wins[top]} of {len(ratios)} configurations); against the best "
                f"peer ({', '.join(self.peers)}): {min(ratios):.2f}-{max(ratios):.2f}x, median "
                f"{statistics.median(ratios):.2f}x (> 1: ours faster)")