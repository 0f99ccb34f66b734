"""Benchmark harness: timing, checking and reporting, shared by every benchmark.

In the spirit of nccl-tests: a benchmark file only says how to make inputs,
what to run, how many bytes that moves and how to check the result; the
harness warms up, times (interleaving the contenders of one row so that noise
on this shared machine hits them alike), checks every result before it
reports a time (the ``#wrong`` column), and prints/saves the table.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["Contender", "Row", "time_interleaved", "print_table", "write_outputs"]


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


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:.2f}"
    return str(v)


def print_table(rows: Sequence[Row], title: str = "") -> str:
    """Print rows as an aligned text table (and return the text)."""
    if not rows:
        return ""
    headers: List[str] = []
    for r in rows:
        for k in r.cols:
            if k not in headers:
                headers.append(k)
    cells = [[_fmt(r.cols.get(h, "")) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for c in cells:
        lines.append("  ".join(v.rjust(w) for v, w in zip(c, widths)))
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
