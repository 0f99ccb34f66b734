"""Take the maximum of a number over the ranks through the library (a synchronous all-reduce) and end the
script at once: the process must exit with status 0.

Run under torchrun by tests/test_futures.py. Before the library kept its collectives' works
(``sparsecomm.collectives.futures.keep``), gloo's worker could let the last one go while the interpreter
finalized: 5 aborts in 20 runs of this script at four ranks on two cores.
"""

import torch
import torch.distributed as dist

from sparsecomm.collectives.dense import max_over_ranks

dist.init_process_group("gloo")
got = max_over_ranks([float(dist.get_rank())], None, torch.device("cpu"))
assert got == [dist.get_world_size() - 1.0], got
print(f"rank {dist.get_rank()} done", flush=True)
