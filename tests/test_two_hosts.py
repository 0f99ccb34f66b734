"""The emulated-hosts scripts (two_hosts.py, cluster.py): real namespaces and capped links (root only)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "two_hosts.py"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                       reason="needs root and iproute2 (ip, tc)"),
]


def _namespaces():
    """The emulated hosts' namespaces on this machine now (a killed run's may be among them: not this test's)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("sc_host")}


def _can_make_namespaces():
    ok = subprocess.run(["ip", "netns", "add", "sc_probe_t"], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", "sc_probe_t"], capture_output=True)
    return ok


def test_local_aggregation_cuts_bytes_between_hosts(tmp_path):
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    before = _namespaces()
    out_json = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--rows", "20000", "--density", "0.02", "--iters", "2",
                          "--rate", "500mbit", "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    flat, local = json.loads(out_json.read_text())
    assert flat["mode"] == "flat" and local["mode"] == "local-aggregation"
    assert 0 < local["inter_host_MB_per_call"] < flat["inter_host_MB_per_call"]
    assert not _namespaces() - before, "the run left its namespaces behind"


def test_cleans_up_when_ranks_fail():
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    before = _namespaces()
    out = subprocess.run([sys.executable, str(SCRIPT), "--rows", "1000", "--fail", "--timeout", "120"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "failed" in out.stderr
    assert not _namespaces() - before, "the run left its namespaces behind"


CLUSTER = SCRIPT.parent / "cluster.py"


def test_cluster_sweep_checks_every_method_and_cleans_up(tmp_path):
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    before = _namespaces()
    out_json = tmp_path / "cluster.json"
    out = subprocess.run([sys.executable, str(CLUSTER), "--topologies", "2x1", "--rates", "500mbit",
                          "--overlaps", "shared", "--densities", "0.01", "--rows", "20000", "--iters", "1",
                          "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = json.loads(out_json.read_text())["records"]
    timed = {r["method"]: r for r in records if "wrong" in r and r["method"] != "tuned"}
    assert set(timed) == {"dense", "torch", "allgather", "partitioned", "tree"}  # two_level needs 2+ ranks/host
    assert all(r["wrong"] == 0 and r["seconds"] > 0 for r in timed.values())
    assert any(r["method"] == "auto" and r["picked"] in timed and r["link_bytes_per_s"] > 0 for r in records)
    # The tuner ran online: explored its candidates (a warm-up and 2 samples each), kept one, timed it in the rounds.
    tuned = [r for r in records if r["method"] == "tuned"]
    assert len(tuned) == 1 and tuned[0]["picked"] in tuned[0]["tried"] and tuned[0]["wrong"] == 0
    assert tuned[0]["explore_syncs"] == 3 * len(tuned[0]["tried"]) and tuned[0]["seconds"] > 0
    assert not _namespaces() - before, "the run left its namespaces behind"


def test_cluster_cleans_up_when_ranks_fail():
    if not _can_make_namespaces():
        pytest.skip("network namespaces not permitted here")
    before = _namespaces()
    out = subprocess.run([sys.executable, str(CLUSTER), "--topologies", "2x1", "--rows", "1000", "--fail",
                          "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "failed" in out.stderr
    assert not _namespaces() - before, "the run left its namespaces behind"
