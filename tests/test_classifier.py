"""The hook's choice of sync method: the bottleneck-link model, the link probe's arithmetic, the measuring tuner."""

import itertools

import pytest
import torch

from sparsecomm.collectives.probe import LinkProbe, alltoall_host_link_bytes
from sparsecomm.collectives import methods
from sparsecomm.collectives.methods import Workload
from sparsecomm.hooks.classifier import bottleneck_bytes, choose_method, collectives, host_layout
from sparsecomm.hooks.tuner import MethodTuner, candidates_near
from sparsecomm.types import SyncMethod as S

from distributed import run_ranks

CLUSTER_METHODS = [S.PARTITIONED, S.ALLGATHER, S.TORCH, S.TREE]


def pick(link, k, u, n=8, lws=2, rows=100_000, dim=32, union_node=None, allowed=CLUSTER_METHODS):
    return choose_method(n, rows, dim, 4, 4, k, u, allowed=allowed, fitted=False, link=link, ranks_per_host=lws,
                         union_node=union_node).method


# ------------------------------------------------------------------ the model


def test_host_layout_and_collectives():
    assert host_layout(8, 2) == 2 and host_layout(8, 3) == 1 and host_layout(8, 8) == 1 and host_layout(8, None) == 1
    assert collectives(S.PARTITIONED, 8, 2) == 9  # two-level: local aggregation first
    assert collectives(S.PARTITIONED, 8, 2, local_aggregation=False) == 4
    assert collectives(S.PARTITIONED, 8, 1) == 4
    assert collectives(S.TORCH, 8) == 21  # three ring all-gathers of N-1 hops
    assert collectives(S.TREE, 8) == 8 and collectives(S.ALLGATHER, 8) == 2


def test_bottleneck_bytes_are_host_link_bytes_when_ranks_share_a_host():
    k, u, un = 1240.0, 9498.0, 2400.0
    args = (8, 100_000, 32, 4, 4, k, u)
    w = Workload(8, 100_000, 32, 4, 4, k, u, 2, un)
    for m, name in ((S.ALLGATHER, "allgather"), (S.TORCH, "torch"), (S.TREE, "tree"), (S.PARTITIONED, "two_level")):
        assert bottleneck_bytes(m, *args, ranks_per_host=2, union_node=un) == pytest.approx(
            methods.by_name(name).host_bytes(w, 4, 2, un))
    # Two ranks share the link: an allgather puts both ranks' k rows to each of the 6 remote ranks on it.
    assert bottleneck_bytes(S.ALLGATHER, *args, ranks_per_host=2) == pytest.approx(2 * 6 * k * 132)
    # One rank per host: the per-rank formulas.
    assert bottleneck_bytes(S.ALLGATHER, *args) == pytest.approx(7 * k * 132)
    assert bottleneck_bytes(S.PARTITIONED, *args) == pytest.approx(7 / 8 * (k + u) * 132)


def test_slow_shared_link_picks_a_merging_path_not_allgather():
    # The last sweep's worst case (4x2, 100 Mbit/s, disjoint hot sets, 5%): the per-rank byte model picked
    # allgather (576 ms measured); the host link carries 2x6 copies of every rank's rows that way.
    slow = LinkProbe(latency_s=2e-3, bytes_per_s=100e6 / 8, ranks_per_host=2)
    assert pick(slow, 1240, 9498, union_node=2480) is S.TREE  # 96 ms measured, the best
    # Same workload on a 10 Gbit/s link: latency dominates, allgather's 2 collectives win (30 ms, the best).
    fast = LinkProbe(latency_s=2e-3, bytes_per_s=10e9 / 8, ranks_per_host=2)
    assert pick(fast, 1240, 9498, union_node=2480) is S.ALLGATHER
    # Few rows: allgather at any rate.
    assert pick(slow, 57, 453) is S.ALLGATHER
    # Ranks' rows nearly the same (U close to k), large rows, slow link: local aggregation first (two-level).
    assert pick(slow, 5000, 6000, dim=256, union_node=5500) is S.PARTITIONED
    # Without local aggregation the flat partitioned path puts L (N-L)/N (k+U) rows on the link, not (M-1)/M (U_n+U).
    flat, two = (bottleneck_bytes(S.PARTITIONED, 8, 100_000, 256, 4, 4, 5000, 6000, 2, 5500, agg)
                 for agg in (False, True))
    assert flat == pytest.approx(2 * 6 / 8 * 11_000 * 1028) and two == pytest.approx(3 / 4 * 11_500 * 1028)


def test_bytes_model_without_a_link_probe_is_unchanged_at_one_rank_per_host():
    # latency_bytes instead of a probe: costs in bytes per rank, as before.
    assert choose_method(4, 1_000_000, 64, 4, 4, rows_mean=10, union_rows=40).method is S.ALLGATHER
    assert choose_method(4, 1_000_000, 64, 4, 4, rows_mean=10_000, union_rows=20_000).method is S.PARTITIONED
    d = choose_method(4, 1_000_000, 64, 4, 4, rows_mean=10_000, union_rows=20_000, ranks_per_host=2)
    assert d.method is S.PARTITIONED and "(2 per host)" in d.reason
    # The reason names every priced method, in milliseconds with a probe.
    d = choose_method(4, 1_000_000, 64, 4, 4, 10, 40, link=LinkProbe(1e-3, 1e9, 1), fitted=False)
    assert "ms per sync" in d.reason and "allgather" in d.reason and "tree" in d.reason


def test_probe_counts_host_link_bytes_of_its_all_to_all():
    assert alltoall_host_link_bytes(8, 1, 8e6) == pytest.approx(7e6)
    assert alltoall_host_link_bytes(8, 2, 8e6) == pytest.approx(2 * 6 / 8 * 8e6)
    assert alltoall_host_link_bytes(8, 3, 8e6) == pytest.approx(7e6)  # not a layout: one rank per host
    p = LinkProbe(latency_s=1e-3, bytes_per_s=1e8)
    assert p.latency_bytes == pytest.approx(1e5)
    assert LinkProbe(1e-9, 1e3).latency_bytes == 1024  # clamped as measure_latency_bytes clamps


# ------------------------------------------------------------------ the tuner


def drive(tuner, calls, local):
    """Run ``calls`` syncs on one simulated rank whose time per method is ``local[method]``; settle on a MAX."""
    used = []
    for call in range(1, calls + 1):
        m = tuner.method(call)
        used.append(m)
        if tuner.record(call, local.get(m, 0.0)):
            yield call, used
            used = []


def test_tuner_schedule_warmup_and_choice():
    t = MethodTuner(["a", "b", "c"], start=2, warmup=1, samples=2, every=10)
    assert t.method(1) is None and t.exploring(2) and t.phase_end == 10
    assert [t.method(c) for c in range(2, 11)] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    times = {"a": [99, 3, 5], "b": [99, 1, 2], "c": [99, 7, 9]}  # the first of each is a warm-up
    for c in range(2, 11):
        m = t.method(c)
        ended = t.record(c, times[m].pop(0))
        assert ended == (c == 10)
    assert t.local_times() == [4, 1.5, 8]
    assert t.settle(t.local_times()) == "b" and t.method(11) == "b" and t.method(20) == "b"
    # Re-measure after `every` syncs: the best and what came within 2x, plus the runner-up ("a", 2.7x).
    assert t.trying == ["a", "b"] and t.phase_start == 21 and t.method(21) == "a" and t.method(24) == "b"
    assert not t.record(15, 123.0)  # outside a phase: ignored


def test_tuner_ranks_agree_on_the_slowest_rank_times():
    # Three ranks see different local times; MAX over ranks makes them take the same method.
    locals_ = [{"x": 1.0, "y": 2.0}, {"x": 5.0, "y": 2.5}, {"x": 1.2, "y": 1.9}]
    tuners = [MethodTuner(["x", "y"], warmup=1, samples=2, every=0) for _ in locals_]
    ends = [list(drive(t, 6, loc)) for t, loc in zip(tuners, locals_)]
    assert [e[0][0] for e in ends] == [6, 6, 6]
    agreed = torch.tensor([t.local_times() for t in tuners]).max(0).values.tolist()
    assert agreed == [5.0, 2.5]
    assert {t.settle(agreed) for t in tuners} == {"y"}  # rank 0 alone would have taken "x"
    assert tuners[0].phase_start > 10 ** 12  # every=0: explore once


def test_tuner_ties_and_errors():
    t = MethodTuner(["p", "q"], warmup=0, samples=1)
    t.record(1, 1.0), t.record(2, 1.0)
    assert t.settle([1.0, 1.0]) == "p"  # a tie goes to the earlier candidate
    with pytest.raises(ValueError):
        t.settle([1.0])
    with pytest.raises(ValueError):
        MethodTuner([])
    with pytest.raises(ValueError):
        MethodTuner(["p"], samples=0)
    assert candidates_near({"a": 10.0, "b": 35.0, "c": 45.0}, 4.0, ["c", "b", "a"]) == ["b", "a"]
    assert candidates_near({}, 4.0, ["a"]) == []


# ------------------------------------------------------------------ the tuner in the hook


def _tuned_hook_worker(rank, world):
    import copy

    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparsecomm
    from sparsecomm.synthetic import zipf_ids

    torch.manual_seed(0)
    base = nn.Embedding(500, 8, sparse=True)
    single, model = copy.deepcopy(base), DDP(copy.deepcopy(base))
    state = sparsecomm.register(model, tune=True, tune_samples=1, tune_every=4)
    opt, opt1 = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(single.parameters(), lr=0.5)
    used = []
    # First phase: 6 candidates x 2 syncs from call 2 (ends at 13); the second starts 4 later at 18 and
    # re-measures those within 2x of the best, up to all 6 on a loaded machine: it ends by call 29.
    for step in range(32):
        ids = [zipf_ids(40, 500, 1.1, seed=100 * step + r) for r in range(world)]
        used.append(state.method_for("weight").value)
        opt.zero_grad()
        model(ids[rank]).pow(2).mean().backward()
        opt.step()
        opt1.zero_grad()
        (sum(single(i).pow(2).mean() for i in ids) / world).backward()
        opt1.step()
    diff = float((model.module.weight - single.weight).abs().max().detach())
    tuner = state._tuners.get("weight")
    return dict(diff=diff, used=used, decision=state.decisions["weight"].method.value,
                reason=state.decisions["weight"].reason, phases=tuner.phases if tuner else 0,
                tried=sorted(m.value for m in tuner.all) if tuner else [])


@pytest.mark.slow
def test_hook_tuner_measures_agrees_and_trains_exactly():
    res = run_ranks(2, _tuned_hook_worker)
    r0 = res[0]
    assert r0["diff"] < 1e-5
    assert len(r0["tried"]) >= 2 and r0["phases"] >= 2  # explored, kept the best, re-measured
    assert r0["reason"].startswith("measured ms/sync")
    # The first sync measures on the partitioned path; then each candidate in turn (a warm-up and a sample).
    assert r0["used"][0] == "partitioned" and len(set(r0["used"][1:1 + 2 * len(r0["tried"])])) == len(r0["tried"])
    assert res[1]["used"] == r0["used"] and res[1]["decision"] == r0["decision"]  # every rank alike


# ------------------------------------------------------------------ the fitted model, per topology


def _synthetic_runs():
    """Cluster records whose times follow the fit's model exactly, with a different latency per topology."""
    from sparsecomm.bench.project import features

    recs = []
    for (hosts, lws, lat), rate, density in itertools.product(
            [(2, 2, 2e-3), (4, 2, 6e-3)], ["100mbit", "300mbit", "1gbit", "10gbit"], [0.001, 0.01, 0.05]):
        k = 1e5 * density * 0.3
        r = dict(hosts=hosts, ranks_per_host=lws, world=hosts * lws, rate=rate, rows=100_000, dim=32, elem_bytes=4,
                 index_bytes=4, k_mean=k, union=3 * k, union_node=1.5 * k, method="tree", wrong=0)
        f = features(r, "tree")
        r["seconds"] = lat * f[0] + 0.6 * f[1] + 0.5e-6 * f[2]
        recs.append(r)
    return recs


def test_fit_per_topology_recovers_each_topologys_terms():
    from sparsecomm.bench.project import fit
    from sparsecomm.cost_model import FittedCost

    recs = _synthetic_runs()
    pooled, err_pooled = fit(recs, ["300mbit"])
    topo, err_topo = fit(recs, ["300mbit"], per_topology=True)
    assert not pooled.topologies and set(topo.topologies) == {"2x2", "4x2"}
    assert topo.topologies["2x2"]["tree"][0] == pytest.approx(2e-3, rel=1e-6)
    assert topo.topologies["4x2"]["tree"][0] == pytest.approx(6e-3, rel=1e-6)
    assert err_topo["tree"]["heldout_max_abs_err"] < 1e-6 < err_pooled["tree"]["heldout_mean_abs_err"]
    # A topology the runs did not cover falls back to the pooled terms; the JSON keeps both.
    assert topo.terms("tree", 8, 8) == topo.coef["tree"] and topo.terms("tree", 4, 2) == topo.topologies["4x2"]["tree"]
    again = FittedCost.from_json(topo.to_json())
    assert again == topo
    tree, w = methods.by_name("tree"), Workload(8, 100_000, 32, 4, 4, 300, 900)
    assert again.seconds(tree, w) == pytest.approx(topo.seconds(tree, w))


def test_latency_prices_each_exchange_by_its_participants():
    from sparsecomm.hooks.classifier import exchange_latency, latency_seconds

    a2a, pair = 8e-3, 2e-3
    assert exchange_latency(2, 8, a2a, pair) == pair and exchange_latency(8, 8, a2a, pair) == a2a
    assert exchange_latency(5, 8, a2a, pair) == pytest.approx(pair + (a2a - pair) / 2)
    assert latency_seconds(S.ALLGATHER, 8, a2a, pair) == 2 * a2a
    assert latency_seconds(S.PARTITIONED, 8, a2a, pair) == 4 * a2a  # flat: 4 all-to-alls among all 8
    # Two-level at 4 hosts x 2: one all-to-all, 4 exchanges in the host (pairs), 4 among the 4 hosts.
    assert latency_seconds(S.PARTITIONED, 8, a2a, pair, ranks_per_host=2) == pytest.approx(
        a2a + 4 * pair + 4 * (pair + (a2a - pair) / 3))
    assert latency_seconds(S.TREE, 8, a2a, pair) == pytest.approx(2 * a2a + 6 * pair)
    assert latency_seconds(S.TORCH, 8, a2a, pair) == pytest.approx(21 * pair)
    # Without a pair measurement every exchange costs an all-to-all (the collective count).
    assert latency_seconds(S.TREE, 8, a2a) == pytest.approx(8 * a2a)
    assert latency_seconds(S.TORCH, 1, a2a, pair) == 0.0


def _probe_worker(rank, world):
    from sparsecomm.collectives.probe import measure_latency_bytes, measure_link

    small = 1 << 20
    return (measure_link(None, ranks_per_host=2, large_bytes=small), measure_link(None, pairs=True, large_bytes=small),
            measure_latency_bytes(None, large_bytes=small))


@pytest.mark.slow
def test_link_probe_is_the_same_on_every_rank():
    res = run_ranks(4, _probe_worker)
    hosts, pairs, lat_bytes = res[0]
    assert all(res[r] == res[0] for r in res)  # the slowest rank's numbers, everywhere
    assert hosts.ranks_per_host == 2 and hosts.pair_latency_s is None and hosts.latency_s > 0
    # One host: all-to-alls go through shared memory, so gloo's own collectives are timed too (and cost more).
    assert hosts.backend_latency_s is not None and hosts.backend_latency_s >= hosts.latency_s
    assert pairs.ranks_per_host == 1 and 0 < pairs.pair_latency_s <= pairs.backend_latency_s
    assert hosts.bytes_per_s > 0 and 1024 <= lat_bytes <= 1 << 26
    # A merge's price: a few GB/s down to a few MB/s of value bytes on any CPU.
    assert 1e-11 < hosts.merge_s_per_byte < 1e-6


def _probe_gloo_worker(rank, world):
    from sparsecomm.collectives.probe import measure_link

    return measure_link(None, large_bytes=1 << 16).backend_latency_s


def test_the_probe_times_the_backend_only_when_all_to_alls_bypass_it():
    assert all(v is not None and v > 0 for v in run_ranks(2, _probe_gloo_worker).values())
    assert run_ranks(2, _probe_gloo_worker, env={"SPARSECOMM_SHM": "0"}) == {0: None, 1: None}


def test_gloo_collectives_are_priced_at_their_own_latency_when_all_to_alls_are_faster():
    from sparsecomm.hooks.classifier import latency_seconds

    a2a, gloo = 3e-5, 1e-3   # shared-memory all-to-all; gloo's all-reduce (measured here: ~0.03 vs 0.3-3 ms)
    assert latency_seconds(S.ALLGATHER, 4, a2a, backend_latency_s=gloo) == pytest.approx(2 * a2a)
    assert latency_seconds(S.PARTITIONED, 4, a2a, backend_latency_s=gloo) == pytest.approx(4 * a2a)
    # densify: its metadata all-to-all, then the table's and the mask's all-reduces on gloo
    assert latency_seconds(S.DENSIFY, 4, a2a, backend_latency_s=gloo) == pytest.approx(a2a + 2 * gloo)
    # torch (gloo's ring all-gathers) and the tree's pairwise stages: gloo hops, unless a pair was measured
    assert latency_seconds(S.TORCH, 4, a2a, backend_latency_s=gloo) == pytest.approx(9 * gloo)
    assert latency_seconds(S.TORCH, 4, a2a, 2e-4, backend_latency_s=gloo) == pytest.approx(9 * 2e-4)
    assert latency_seconds(S.TREE, 8, a2a, backend_latency_s=gloo) == pytest.approx(2 * a2a + 6 * gloo)
    # and choose_method sees it: on a small, sparse table the cheap all-to-all path wins over gloo's
    d = choose_method(4, 100_000, 16, 4, 4, 50, 180, link=LinkProbe(a2a, 3e9, 1, None, gloo), fitted=False)
    assert d.method is S.ALLGATHER, d.reason
    assert "other collectives 1 ms" in d.reason, d.reason


def test_a_dense_bucket_fuses_when_its_extra_bytes_cost_less_than_its_own_all_reduce():
    from sparsecomm.hooks.state import SparseCommState

    state = SparseCommState.__new__(SparseCommState)   # the decision alone: no process group needed
    state.fuse_dense, state.compression, state.world_size, state.latency_bytes = True, None, 4, 64 * 1024
    state.row_tables = True
    bucket = torch.zeros(64 * 1024)   # 256 KB: the fused exchange moves 3 x 256 KB against a ring's 1.5 x 256 KB
    state.link = None
    assert not state.fuses_dense(bucket)   # 384 KB extra > 64 KB of an all-to-all's latency
    # All-to-alls through shared memory (30 us) but the bucket's own all-reduce on gloo (1 ms at 3 GB/s: 3 MB):
    state.link = LinkProbe(3e-5, 3e9, 1, None, 1e-3)
    assert state.fuses_dense(bucket)
    state.row_tables = False   # no table for the hook to sync: an exchange of its own, through shared memory
    assert state.fuses_dense(bucket)
    state.link = LinkProbe(3e-3, 3e9, 1)   # ... but not through the backend, whatever the bytes
    assert not state.fuses_dense(torch.zeros(16))
    state.row_tables = True
    state.link = LinkProbe(3e-5, 3e9, 1)   # no backend timing: priced as latency_bytes
    assert not state.fuses_dense(bucket)
