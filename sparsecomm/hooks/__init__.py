"""DDP communication hooks and the gradient classifier.

One job per file: ``state`` (settings, decisions, counters), ``hook`` (bucket
dispatch and the step's fused sparse sync, ``register``), ``dense_rows``
(embeddings with dense gradients), ``unused`` (tables a step does not use),
``classifier`` (which path a table takes).
"""

from sparsecomm.hooks.classifier import Decision, choose_method
from sparsecomm.hooks.hook import register, sparsecomm_hook
from sparsecomm.hooks.state import PathStats, SparseCommState

__all__ = ["Decision", "choose_method", "PathStats", "SparseCommState", "register", "sparsecomm_hook"]
