"""Sharded embeddings against TorchRec's row-wise sharding (see sparsecomm/bench/sharded.py): python benchmarks/bench_sharded.py --help

    python benchmarks/bench_sharded.py --nproc 2,4            # world sizes 2 and 4, self-spawned
    torchrun --nproc-per-node 4 benchmarks/bench_sharded.py
"""
import sys

from sparsecomm.bench.sharded import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
