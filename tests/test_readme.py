"""Every ```python block of README.md and docs/*.md runs, as written, on 2 real ranks: the docs cannot drift.

Each block is matched to one :class:`Snippet` below by a line it contains.
The snippet's ``prelude`` defines what the README leaves to the reader
(``MyModel``, ``data``, ``grad``, ...), the block runs unchanged after it in a
fresh namespace, and ``check`` asserts what the block promises (the loss goes
down, replicas agree, the sums are right). A block with no snippet fails the
test, and so does a snippet whose block is gone.

**Adding a block** (to the README or a page of docs/): add one ``Snippet(marker=..., prelude=..., check=...)``
to ``SNIPPETS``: ``marker`` a line unique to the block, the prelude defining its
placeholders, the check asserting its result (it may set ``result``, a list of
tensors compared across ranks when ``same_on_every_rank``).

Both ranks run every block in one spawn (gloo, FileStore, a timeout on every
collective), the blocks marked ``slow`` in a second one under ``pytest -m
slow``. ``sparsecomm.init_distributed()`` finds the group already made, and
``sparsecomm.shutdown()`` is counted instead of tearing the group down
between blocks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose python blocks run: the README and every page of docs/.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
WORLD = 2


@dataclass(frozen=True)
class Snippet:
    """How to run one block of the README or of a docs page.

    Attributes:
        marker: a line (or part of one) that only this block contains.
        prelude: code run first, defining the block's placeholders.
        check: code run after the block, asserting its promise; may set ``result``.
        same_on_every_rank: ``result`` must be equal on every rank (e.g. synchronized weights).
        slow: runs with ``pytest -m slow`` (CI runs it), not in the default suite.
    """

    marker: str
    prelude: str = ""
    check: str = ""
    same_on_every_rank: bool = False
    slow: bool = False


# Shared by the preludes: imports a reader has from the README's first block, and a
# loss recorder: ``Batches(items, ns)`` yields the batches and records ``ns["loss"]``
# after each step, so a check can see whether training went anywhere.
COMMON = '''
import torch, torch.nn as nn, sparsecomm
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
RANK = dist.get_rank()

class Batches:
    def __init__(self, items, ns):
        self.items, self.ns, self.losses = items, ns, []
    def __iter__(self):
        for item in self.items:
            yield item
            self.losses.append(float(self.ns["loss"].detach()))
'''

# The model of the README's and docs/HOOK.md's register snippets.
MY_MODEL = '''
class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(2000, 16, mode="sum", sparse=True)
        self.mlp = nn.Linear(16, 1)
    def forward(self, ids):
        return self.mlp(self.emb(ids))
'''

SNIPPETS: List[Snippet] = [
    Snippet(  # README "In one call: sparsecomm.parallelize"
        marker="model, opt = sparsecomm.parallelize(",
        prelude='''
class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(100_000, 16, mode="sum", sparse=True)   # 12.8 MB with its state: a candidate
        self.small = nn.Embedding(1000, 16, sparse=True)                   # replicated
        self.mlp = nn.Linear(32, 1)
    def forward(self, b):
        return self.mlp(torch.cat([self.big(b[0]), self.small(b[1])], 1))

torch.manual_seed(0)
g = torch.Generator().manual_seed(300 + RANK)
first = (torch.randint(0, 100_000, (32, 4), generator=g), torch.randint(0, 1000, (32,), generator=g))
sample_batch, data = first, Batches([first] * 12, globals())
''',
        check='''
assert data.losses[-1] < data.losses[0], data.losses
# "big" is sharded only where the plan predicts it pays (its reason says why either way); "small" never is.
assert set(plan.sharded()) <= {"big"} and plan["small"].placement == "replicate" and plan["big"].reason, plan
assert isinstance(opt, torch.optim.Optimizer) and os.path.exists("run1/manifest.json")
assert sparsecomm.Plan.from_checkpoint("run1/").sharded() == plan.sharded() and shutdown_calls == 1
big = model.module.big
result = [big.full_weight() if plan.sharded() else big.weight.detach().clone(), model.module.small.weight.detach().clone()]
''',
        same_on_every_rank=True,
    ),
    Snippet(  # docs/PARALLELIZE.md "The next batch's ids while this one trains"
        marker="for batch in sparsecomm.pipeline(loader, ddp):",
        prelude='''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(100_000, 16, mode="sum", sparse=True)
        self.mlp = nn.Linear(16, 1)
    def forward(self, b):
        return self.mlp(self.big(b["ids"])).squeeze(1)

torch.manual_seed(0)
g = torch.Generator().manual_seed(400 + RANK)
net, losses = Net(), []
batch0 = {"ids": torch.randint(0, 100_000, (32, 4), generator=g), "y": torch.randn(32, generator=g)}
loader = [batch0] * 10

def loss_fn(out, y):
    loss = ((out - y) ** 2).mean()
    losses.append(float(loss))
    return loss
''',
        check='''
assert len(losses) == 10 and losses[-1] < losses[0], losses
''',
    ),
    Snippet(  # README "In a DDP model: sparsecomm.register"
        marker="state = sparsecomm.register(ddp)",
        prelude=MY_MODEL + '''
torch.manual_seed(0)
g = torch.Generator().manual_seed(100 + RANK)  # each rank its own batch, trained 12 times
data = Batches([torch.randint(0, 2000, (32, 4), generator=g)] * 12, globals())
''',
        check='''
assert data.losses[-1] < data.losses[0], data.losses
assert "emb.weight" in state.decisions and "emb.weight ->" in state.summary()
assert sum(s.calls for s in state.stats.values()) > 0 and shutdown_calls == 1
result = [p.detach().clone() for p in model.parameters()]  # replicas must agree
''',
        same_on_every_rank=True,
    ),
    Snippet(  # docs/HOOK.md "register, the PyTorch way"
        marker="ddp.register_comm_hook(state, sparsecomm.sparsecomm_hook)",
        prelude=MY_MODEL + '''
torch.manual_seed(0)
model = MyModel()
''',
        check='''
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ids = torch.randint(0, 2000, (32, 4), generator=torch.Generator().manual_seed(400 + RANK))
for _ in range(3):
    opt.zero_grad(); ddp(ids).pow(2).mean().backward(); opt.step()
assert state.iteration == 3 and state.config.fuse_dense and "emb.weight" in state.decisions, state.summary()
result = [p.detach().clone() for p in model.parameters()]  # replicas must agree
''',
        same_on_every_rank=True,
    ),
    Snippet(  # docs/HOOK.md "The collective under the hook"
        marker="out = sparsecomm.sparse_allreduce(grad, op=\"avg\")",
        prelude='''
def grad_of(rank, seed, rows=500, dim=4):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    ids = torch.randint(0, rows, (40,), generator=g)
    return torch.sparse_coo_tensor(ids[None], torch.randn(40, dim, generator=g, dtype=torch.float64),
                                   (rows, dim), check_invariants=True).coalesce()

N = dist.get_world_size()
grad, g1, g2, g3 = (grad_of(RANK, s) for s in range(4))
''',
        check='''
def total(seed):
    return sum(grad_of(r, seed).to_dense() for r in range(N))

torch.testing.assert_close(out.to_dense(), total(0) / N)
torch.testing.assert_close(fut.wait().to_dense(), total(0))
assert stats.bytes_sent > 0 and stats.world_size == N
for i, o in enumerate(outs, start=1):
    torch.testing.assert_close(o.to_dense(), total(i) / N)
''',
    ),
    Snippet(  # README "Sharded tables by hand"
        marker="self.bags = sparsecomm.ShardedEmbeddingBag(",
        prelude='''
torch.manual_seed(0)
g = torch.Generator().manual_seed(200 + RANK)
ids0 = torch.randint(0, 1_000_000, (64, 5), generator=g)
data = Batches([(ids0, torch.randn(64, generator=g))] * 12, globals())
''',
        check='''
assert data.losses[-1] < data.losses[0], data.losses
assert os.path.isdir("ckpt") and os.listdir("ckpt")
with torch.no_grad():
    result = model(ids0).sum().item()  # the model still runs after the reload
''',
        slow=True,  # a 1M x 64 table, its Adagrad state and a checkpoint of both: ~10 s on 2 cores
    ),
]


def python_blocks(text: str) -> List[Tuple[int, str]]:
    """``(line number, code)`` of every ```python fenced block, indented ones included."""
    blocks = []
    pattern = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
    for m in pattern.finditer(text):
        indent = m.group(1)
        code = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in m.group(2).splitlines(keepends=True))
        blocks.append((text.count("\n", 0, m.start()) + 1, code))
    return blocks


def page_blocks(pages: List[Path] = PAGES) -> List[Tuple[str, str]]:
    """``("README.md:12", code)`` for every python block of ``pages``, in page order."""
    return [(f"{page.relative_to(ROOT).as_posix()}:{line}", code)
            for page in pages for line, code in python_blocks(page.read_text())]


def match_blocks(blocks: List[Tuple[str, str]]) -> List[Tuple[Snippet, str, str]]:
    """Pair every block with its snippet; fail on a block without one or a snippet without a block."""
    pairs = []
    for where, code in blocks:
        found = [s for s in SNIPPETS if s.marker in code]
        assert found, (f"{where}: a python block that tests/test_readme.py does not know how to "
                       f"run; add a Snippet for it to SNIPPETS (a marker line, a prelude defining its "
                       f"placeholders, a check):\n{code}")
        assert len(found) == 1, f"{where}: markers of several snippets match: {found}"
        pairs.append((found[0], where, code))
    stale = [s.marker for s in SNIPPETS if s not in [p[0] for p in pairs]]
    assert not stale, f"snippets whose block is gone from README.md and docs/ (remove or update them): {stale}"
    return pairs


def _run_blocks(rank: int, world: int, blocks: List[Tuple[Snippet, str, str]], workdir: str) -> Dict[str, object]:
    import sparsecomm

    os.chdir(workdir)  # the blocks write relative paths (ckpt/)
    results = {}
    for snippet, where, code in blocks:
        calls = []
        sparsecomm.shutdown = lambda: calls.append(1)  # keep the group for the next block; count the call
        ns = {"__name__": "block_" + re.sub(r"\W", "_", where), "os": os}
        exec(compile(COMMON + snippet.prelude, f"<prelude of {where}>", "exec"), ns)
        exec(compile(code, where, "exec"), ns)
        ns["shutdown_calls"] = len(calls)
        exec(compile(snippet.check, f"<check of {where}>", "exec"), ns)
        results[where] = ns.get("result")
    return results


def test_every_python_block_has_a_snippet():
    blocks = match_blocks(page_blocks())
    assert len(blocks) == len(SNIPPETS)


def test_the_docs_pages_are_scanned():
    names = [p.relative_to(ROOT).as_posix() for p in PAGES]
    assert names[0] == "README.md" and {"docs/INSTALL.md", "docs/BENCHMARKS.md", "docs/DESIGN.md"} <= set(names), names


def test_an_unknown_block_fails_with_what_to_do():
    blocks = page_blocks() + [("docs/NEW.md:3", "sparsecomm.something_new()\n")]
    with pytest.raises(AssertionError, match="docs/NEW.md:3: .*does not know how to run; add a Snippet"):
        match_blocks(blocks)
    # Indented blocks (inside a list item) count too.
    assert python_blocks("- item\n\n  ```python\n  x = 1\n  ```\n") == [(3, "x = 1\n")]


def _run_on_two_ranks(tmp_path, slow: bool) -> None:
    import torch

    blocks = [b for b in match_blocks(page_blocks()) if b[0].slow == slow]
    assert blocks
    results = run_ranks(WORLD, _run_blocks, blocks, str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    for snippet, where, _ in blocks:
        if snippet.same_on_every_rank:
            first = results[0][where]
            for r in range(1, WORLD):
                other = results[r][where]
                assert all(torch.equal(a, b) for a, b in zip(first, other)), f"{where}: ranks differ"


def test_python_blocks_run_on_two_ranks(tmp_path):
    _run_on_two_ranks(tmp_path, slow=False)


@pytest.mark.slow
def test_slow_python_blocks_run_on_two_ranks(tmp_path):
    _run_on_two_ranks(tmp_path, slow=True)
