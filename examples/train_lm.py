"""A word-level language model in the spirit of Parallax's LM1B workload, on a seeded synthetic corpus.

A large sparse input embedding (nn.Embedding, sparse=True), an LSTM, and a
sparse output embedding trained with a sampled softmax (the LM1B recipe), so
both big tables produce sparse gradients. The corpus is generated on the fly:
a Zipf-distributed vocabulary where each word has a few likely successors,
so there is structure to learn and the loss falls visibly. Nothing is
downloaded.

    python examples/train_lm.py
    torchrun --nproc-per-node 4 examples/train_lm.py                 # sparsecomm.parallelize (planned)
    torchrun --nproc-per-node 4 examples/train_lm.py --mode sparsecomm
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/train_lm.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HelpFormatter, add_common_args, finish, optimizer_step, prepare, setup, train, unwrap  # noqa: E402

from sparsecomm.synthetic import zipf_ids  # noqa: E402


class ZipfCorpus:
    """Sentences from a bigram chain over a Zipf vocabulary.

    Each word has ``fanout`` successors chosen once (seeded); with probability
    ``p_follow`` the next word is one of them (itself Zipf-weighted), else a
    fresh Zipf draw. A perfect model reaches far below the unigram entropy.
    """

    def __init__(self, vocab: int, alpha: float, fanout: int = 4, p_follow: float = 0.8, seed: int = 0):
        self.vocab, self.alpha, self.fanout, self.p_follow, self.seed = vocab, alpha, fanout, p_follow, seed
        self.successors = zipf_ids(vocab * fanout, vocab, alpha, seed=seed).view(vocab, fanout)

    def batch(self, n: int, length: int, stream: int, step: int) -> torch.Tensor:
        seed = (self.seed * 1_000_003 + stream * 7919 + step) % (2**31)
        g = torch.Generator().manual_seed(seed)
        fresh = zipf_ids(n * (length + 1), self.vocab, self.alpha, seed=seed).view(n, length + 1)
        pick = torch.multinomial(torch.tensor([0.5, 0.25, 0.15, 0.1][: self.fanout]), n * (length + 1),
                                 replacement=True, generator=g).view(n, length + 1)
        follow = torch.rand(n, length + 1, generator=g) < self.p_follow
        words = torch.empty(n, length + 1, dtype=torch.int64)
        words[:, 0] = fresh[:, 0]
        for t in range(1, length + 1):
            nxt = self.successors[words[:, t - 1], pick[:, t]]
            words[:, t] = torch.where(follow[:, t], nxt, fresh[:, t])
        return words


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, dim)
        self.out_embed = nn.Embedding(vocab, dim, sparse=True)  # output word vectors
        self.out_bias = nn.Embedding(vocab, 1, sparse=True)

    def forward(self, words: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Sampled-softmax loss: each target against shared sampled negatives."""
        inputs, targets = words[:, :-1], words[:, 1:].reshape(-1)
        # Every lookup before any use: sharded tables then share one exchange (sparsecomm.parallelize).
        x, out_t, bias_t = self.embed(inputs), self.out_embed(targets), self.out_bias(targets)
        out_n, bias_n = self.out_embed(negatives), self.out_bias(negatives)
        h, _ = self.lstm(x)
        h = self.proj(h).reshape(-1, self.proj.out_features)
        true_logit = (h * out_t).sum(1, keepdim=True) + bias_t
        neg_logit = h @ out_n.t() + bias_n.t()
        # A negative that equals the target is not a negative.
        neg_logit = neg_logit.masked_fill(negatives[None, :] == targets[:, None], float("-inf"))
        logits = torch.cat([true_logit, neg_logit], 1)
        return F.cross_entropy(logits, torch.zeros(len(targets), dtype=torch.int64))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.set_defaults(batch_size=64)
    p.add_argument("--vocab", type=int, default=100_000, help="vocabulary size (rows of each table)")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--hidden", type=int, default=128, help="LSTM width")
    p.add_argument("--seq-len", type=int, default=20)
    p.add_argument("--negatives", type=int, default=256, help="sampled-softmax negatives per step")
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf skew of the vocabulary")
    args = p.parse_args(argv)
    topo = setup(args)
    corpus = ZipfCorpus(args.vocab, args.alpha, seed=args.seed)
    torch.manual_seed(args.seed)
    words0 = corpus.batch(args.batch_size, args.seq_len, stream=topo.rank, step=0)
    negatives0 = zipf_ids(args.negatives, args.vocab, args.alpha, seed=7_000_000)
    sample = lambda m: m(words0, negatives0)  # noqa: E731  (one batch through the model: the plan measures its ids)
    model, opt, state = prepare(LSTMLM(args.vocab, args.dim, args.hidden), args, torch.optim.Adam,
                                args.lr or 0.01, sample)
    held_out = corpus.batch(256, args.seq_len, stream=10_000, step=0)
    eval_negatives = zipf_ids(args.negatives, args.vocab, args.alpha, seed=123_456)

    def step(i: int) -> float:
        words = corpus.batch(args.batch_size, args.seq_len, stream=topo.rank, step=i)
        # Negatives: the same on every rank for a step (seeded by the step), Zipf like the words.
        negatives = zipf_ids(args.negatives, args.vocab, args.alpha, seed=7_000_000 + i)
        return optimizer_step(opt, model(words, negatives))

    def evaluate():
        with torch.no_grad():
            loss = float(unwrap(model)(held_out, eval_negatives))
        return {"sampled_loss": loss, "sampled_ppl": math.exp(loss)}

    train(args, topo, step, evaluate, args.batch_size * args.seq_len * topo.world_size, state, name="lm",
          unit="tokens", model=model)
    finish()


if __name__ == "__main__":
    main()
