"""``python -m sparsecomm.bench BENCHMARK [options]`` (also the ``sparsecomm-bench`` script)."""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# name -> (module, one line for the list)
BENCHMARKS = {
    "kernels": ("sparsecomm.bench.kernels", "the row kernels (coalesce, gather, scatter-add, partition) against torch"),
    "allreduce": ("sparsecomm.bench.allreduce", "dense collectives, nccl-tests style: all_reduce, all_gather, "
                                                "all_to_all"),
    "sparse_sync": ("sparsecomm.bench.sparse_sync", "one sparse gradient synchronized: sparsecomm against dense, "
                                                    "torch's sparse all_reduce, allgather"),
    "sharded": ("sparsecomm.bench.sharded", "a sharded embedding's training step against TorchRec's row-wise one"),
    "e2e": ("sparsecomm.bench.e2e", "end-to-end training against plain DDP (and TorchRec), on one host or "
                                    "--hosts H emulated hosts"),
    "migrate": ("sparsecomm.bench.migrate", "moving one large table between placements (replan), whole or from a "
                                            "stale replica, in steps"),
    "project": ("sparsecomm.bench.project", "fit a time model to emulated-cluster runs and project to 64-128 ranks"),
}


def usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = ["usage: python -m sparsecomm.bench BENCHMARK [options]   (BENCHMARK --help for its options)", "",
             "benchmarks:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        why = "no benchmark named" if not argv else f"unknown benchmark {argv[0]!r}"
        print(f"sparsecomm.bench: {why}\n\n{usage()}", file=sys.stderr)
        return 2
    result = importlib.import_module(BENCHMARKS[argv[0]][0]).run(argv[1:])
    # Distributed benchmarks return their exit status (non-zero: a wrong result or a failed rank).
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
