"""The emulated-hosts scripts (two_hosts.py, cluster.py): real namespaces and capped links (root only)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparsecomm.bench.netns import EmulatedCluster

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "two_hosts.py"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                       reason="needs root and iproute2 (ip, tc)"),
]


def _run(argv):
    """Run a script; return (exit status, stderr, the namespaces of that run still on this machine).

    A script's namespaces carry its process id (``EmulatedCluster``), so the
    check ignores other runs' namespaces made or left meanwhile.
    """
    mine = EmulatedCluster(2, "1gbit")   # names only: nothing is made before __enter__
    assert mine.ns[0] == f"sc_host{os.getpid() % 100000}h0" and mine.switch == f"sc_host{os.getpid() % 100000}sw"
    proc = subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    tag = proc.pid % 100000
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = {line.split()[0] for line in out.splitlines()}
    return proc.returncode, err, {ns for ns in left if ns.startswith(f"sc_host{tag}h") or ns == f"sc_host{tag}sw"}


def _can_make_namespaces():
    ok = subprocess.run(["ip", "netns", "add", "sc_probe_t"], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", "sc_probe_t"], capture_output=True)
    return ok


def test_local_aggregation_cuts_bytes_between_hosts(tmp_path):
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    out_json = tmp_path / "rows.json"
    rc, err, left = _run([SCRIPT, "--rows", "20000", "--density", "0.02", "--iters", "2", "--rate", "500mbit",
                          "--json", out_json])
    assert rc == 0, err[-3000:]
    flat, local = json.loads(out_json.read_text())
    assert flat["mode"] == "flat" and local["mode"] == "local-aggregation"
    assert 0 < local["inter_host_MB_per_call"] < flat["inter_host_MB_per_call"]
    assert not left, f"the run left its namespaces behind: {sorted(left)}"


def test_cleans_up_when_ranks_fail():
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    rc, err, left = _run([SCRIPT, "--rows", "1000", "--fail", "--timeout", "120"])
    assert rc == 1 and "failed" in err
    assert not left, f"the run left its namespaces behind: {sorted(left)}"


CLUSTER = SCRIPT.parent / "cluster.py"


def test_cluster_sweep_checks_every_method_and_cleans_up(tmp_path):
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    out_json = tmp_path / "cluster.json"
    rc, err, left = _run([CLUSTER, "--topologies", "2x1", "--rates", "500mbit", "--overlaps", "shared",
                          "--densities", "0.01", "--rows", "20000", "--iters", "1", "--json", out_json])
    assert rc == 0, err[-3000:]
    records = json.loads(out_json.read_text())["records"]
    timed = {r["method"]: r for r in records if "wrong" in r and r["method"] != "tuned"}
    assert set(timed) == {"dense", "torch", "allgather", "partitioned", "tree", "runs"}  # two_level: 2+ ranks/host
    assert all(r["wrong"] == 0 and r["seconds"] > 0 for r in timed.values())
    assert any(r["method"] == "auto" and r["picked"] in timed and r["link_bytes_per_s"] > 0 for r in records)
    # The tuner ran online: explored its candidates (a warm-up and 2 samples each), kept one, timed it in the rounds.
    tuned = [r for r in records if r["method"] == "tuned"]
    assert len(tuned) == 1 and tuned[0]["picked"] in tuned[0]["tried"] and tuned[0]["wrong"] == 0
    assert tuned[0]["explore_syncs"] == 3 * len(tuned[0]["tried"]) and tuned[0]["seconds"] > 0
    assert not left, f"the run left its namespaces behind: {sorted(left)}"


def test_cluster_cleans_up_when_ranks_fail():
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    rc, err, left = _run([CLUSTER, "--topologies", "2x1", "--rows", "1000", "--fail", "--timeout", "120"])
    assert rc == 1 and "failed" in err
    assert not left, f"the run left its namespaces behind: {sorted(left)}"
