"""End a script right after synchronous collectives, the library's and then torch's own: the process must exit
with status 0.

Run under torchrun by tests/test_futures.py. gloo's worker lets a completed collective's tensors go on its own
thread, taking the GIL; during the interpreter's finalization that aborts the process. Four ranks on two cores:
5 aborts in 20 runs ending on the library's ``max_over_ranks`` before it kept its works
(``sparsecomm.collectives.futures.keep``), and 15 in 20 ending on a bare ``dist.all_reduce`` (what
``torch.distributed.checkpoint``'s gathers are to the library) before its exit waited for the other threads to
settle (``settle_threads``).
"""

import torch
import torch.distributed as dist

from sparsecomm.collectives.dense import max_over_ranks

dist.init_process_group("gloo")
got = max_over_ranks([float(dist.get_rank())], None, torch.device("cpu"))
assert got == [dist.get_world_size() - 1.0], got
x = torch.ones(1000)
dist.all_reduce(x)   # torch's own, not kept by the library
assert x[0] == dist.get_world_size()
print(f"rank {dist.get_rank()} done", flush=True)
