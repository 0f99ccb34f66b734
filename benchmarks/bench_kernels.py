"""Row-kernel benchmark (see sparsecomm/bench/kernels.py): python benchmarks/bench_kernels.py --help"""
import sys

from sparsecomm.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["kernels", *sys.argv[1:]]))
