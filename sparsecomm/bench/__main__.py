"""``python -m sparsecomm.bench BENCHMARK [options]`` (also the ``sparsecomm-bench`` script)."""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

BENCHMARKS = {
    "kernels": "sparsecomm.bench.kernels",
    "allreduce": "sparsecomm.bench.allreduce",
    "sparse_sync": "sparsecomm.bench.sparse_sync",
    "sharded": "sparsecomm.bench.sharded",
    "project": "sparsecomm.bench.project",
    "e2e": "sparsecomm.bench.e2e",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m sparsecomm.bench {{{','.join(BENCHMARKS)}}} [options]  (--help per benchmark)")
        return 2
    result = importlib.import_module(BENCHMARKS[argv[0]]).run(argv[1:])
    # Distributed benchmarks return their exit status (non-zero: a wrong result or a failed rank).
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
