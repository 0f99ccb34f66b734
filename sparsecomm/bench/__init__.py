"""Benchmarks: ``python -m sparsecomm.bench {kernels,...} --help``."""
