"""DDP communication hooks and the gradient classifier.

One job per file: ``config`` (the hook's tunable settings, validated),
``state`` (settings, decisions, counters), ``step`` (what one backward has in
flight), ``hook`` (bucket dispatch and the step's fused sparse sync,
``register``), ``dense_rows`` (embeddings with dense gradients), ``unused``
(tables a step does not use), ``tuner`` (a measured choice of path),
``classifier`` (which path a table takes).
"""

from sparsecomm.hooks.classifier import Decision, choose_method
from sparsecomm.hooks.config import HookConfig
from sparsecomm.hooks.hook import register, sparsecomm_hook
from sparsecomm.hooks.state import PathStats, SparseCommState

__all__ = ["Decision", "choose_method", "HookConfig", "PathStats", "SparseCommState", "register", "sparsecomm_hook"]
