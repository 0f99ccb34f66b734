"""DDP communication hooks and the gradient classifier."""

from sparsecomm.hooks.classifier import Decision, choose_method
from sparsecomm.hooks.sparse_hook import PathStats, SparseCommState, register, sparsecomm_hook

__all__ = ["Decision", "choose_method", "PathStats", "SparseCommState", "register", "sparsecomm_hook"]
