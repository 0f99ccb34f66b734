"""Run under any launcher: init, one sparse_allreduce, print one JSON line per rank."""
import json

import torch

import sparsecomm

topo = sparsecomm.init_distributed(timeout=60)
t = torch.sparse_coo_tensor(torch.tensor([[topo.rank, 7]]), torch.ones(2, 2), (16, 2), check_invariants=False)
out = sparsecomm.sparse_allreduce(t).to_dense()
print(json.dumps({"rank": topo.rank, "world": topo.world_size, "local_world": topo.local_world_size,
                  "row7": out[7].tolist(), "row_own": out[topo.rank].tolist()}), flush=True)
sparsecomm.shutdown()
