"""Sparse gradient sync against its peers (see sparsecomm/bench/sparse_sync.py): python benchmarks/bench_sparse.py --help

    python benchmarks/bench_sparse.py --nproc 4               # 4 local ranks, self-spawned
    python benchmarks/bench_sparse.py --nproc 2,3,4           # scaling
    torchrun --nproc-per-node 4 benchmarks/bench_sparse.py
    mpirun -np 4 python benchmarks/bench_sparse.py
"""
import sys

from sparsecomm.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["sparse_sync", *sys.argv[1:]]))
