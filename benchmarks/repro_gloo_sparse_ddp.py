"""Plain DDP with sparse embeddings on gloo, without sparsecomm: a crash of torch's own sparse allreduce.

Reproduces the intermittent SIGSEGV / SIGABRT ("malloc(): unaligned tcache
chunk detected") seen in plain-DDP reference runs of the test suite. Nothing
of sparsecomm is imported: a fresh DDP model with a sparse Embedding and a
sparse EmbeddingBag (mean) trains 20 steps on small random batches, over and
over, for the given number of seconds.

    torchrun --nproc-per-node 2 benchmarks/repro_gloo_sparse_ddp.py 120

Measured here (2026-11-30, torch 2.13.0 CPU, 2 cores): 3 of 6 runs of 100-120 s
died (SIGSEGV in the main thread inside DDP's backward, or SIGABRT), after a
few hundred models each; the other runs finished ("iterations N ok"). The
test suite's plain-DDP references therefore train dense-gradient twins
(sparse=False), which take gloo's dense allreduce.
"""
import os, sys, time, faulthandler, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
faulthandler.enable()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.e = nn.Embedding(500, 8, sparse=True); s.b = nn.EmbeddingBag(300, 8, mode="mean", sparse=True); s.l = nn.Linear(16, 1)
    def forward(s, x, y):
        return s.l(torch.cat([s.e(x).sum(1), s.b(y)], 1))
deadline = time.time() + float(sys.argv[1])
it = 0
while time.time() < deadline:
    torch.manual_seed(it)
    m = DDP(M())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(it * 10 + rank)
    for step in range(20):
        n = int(torch.randint(1, 40, (1,), generator=g))
        x = torch.randint(0, 500, (n, 3), generator=g); y = torch.randint(0, 300, (n, 4), generator=g)
        loss = m(x, y).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
    it += 1
if rank == 0: print("iterations", it, "ok", flush=True)
dist.destroy_process_group()
