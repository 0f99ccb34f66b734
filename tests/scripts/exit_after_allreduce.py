"""Average a bucket over the ranks through the library's dense path (a chained callback, as the DDP hook
chains one), wait, and end the script at once: the process must exit with status 0.

Run under torchrun by tests/test_futures.py.
"""

import torch
import torch.distributed as dist

from sparsecomm.collectives.dense import allreduce_mean_async
from sparsecomm.collectives.futures import then

dist.init_process_group("gloo")
world = dist.get_world_size()
bucket = torch.empty(1 << 12)
for step in range(30):
    bucket.fill_(float(dist.get_rank() + step))
    done = then(allreduce_mean_async(bucket, None), lambda f: f.value() * 1)
    expected = step + (world - 1) / 2
    assert torch.equal(done.wait(), torch.full_like(bucket, expected)), step
print(f"rank {dist.get_rank()} done", flush=True)
