"""Dense collectives, nccl-tests style (see sparsecomm/bench/allreduce.py): python benchmarks/bench_allreduce.py --help

    python benchmarks/bench_allreduce.py --nproc 4            # 4 local ranks, self-spawned
    torchrun --nproc-per-node 4 benchmarks/bench_allreduce.py
    mpirun -np 4 python benchmarks/bench_allreduce.py
"""
import sys

from sparsecomm.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["allreduce", *sys.argv[1:]]))
