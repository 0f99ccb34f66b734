"""sparsecomm: sparsity-aware data-parallel communication for PyTorch."""

from sparsecomm import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
