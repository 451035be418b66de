"""Topology, pinning from inside the child, the lock, and the comparison check."""

import os

import pytest
from harness_cli import cli

from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.isolation.compare import ComparisonRefused, check_comparable
from edge_infer.api import (
    choose_cores,
    largest_cache_bytes,
    parse_cpu_list,
    physical_cores,
)


def fake_sysfs(root, siblings: dict[int, str]):
    for cpu, sib in siblings.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(sib + "\n")
    return root


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def test_physical_cores_never_two_hyperthreads(tmp_path):
    # 4 cores x 2 threads, Linux numbering: cpu N and N+4 are siblings
    root = fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert physical_cores(list(range(8)), root) == [0, 1, 2, 3]
    assert physical_cores([2, 5, 6, 7], root) == [2, 5, 7]  # 6 is 2's sibling
    # adjacent numbering (0,1 share a core)
    root2 = fake_sysfs(tmp_path / "b", {c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(4)})
    assert physical_cores(list(range(4)), root2) == [0, 2]


def test_choose_cores_refuses_siblings(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path, {c: f"{c % 2},{c % 2 + 2}" for c in range(4)})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(Exception, match="hyper-threads of one physical core"):
        choose_cores("0,2", None, root)
    assert choose_cores("0,1", None, root) == [0, 1]
    assert choose_cores(None, 1, root) == [0]
    with pytest.raises(Exception, match="-t 3"):
        choose_cores(None, 3, root)


@pytest.mark.parametrize("which", ["first", "last"])
def test_pinning_seen_from_inside_the_child(which):
    cores = physical_cores()
    core = cores[0] if which == "first" else cores[-1]
    with Worker([core], label="pin-test") as w:
        assert w.hello["affinity"] == [core]  # reported before anything was imported
        reply = w.request("affinity")
        assert reply["affinity"] == [core]
        assert all(aff == [core] for aff in reply["tasks"].values())


def test_pinning_survives_engine_threads(smollm2):
    """llama.cpp's OpenMP threads are born inside the pinned set."""
    from edge_harness.runners.base import ModelRef
    from edge_harness.runners.llamacpp import LlamaCppRunner

    core = physical_cores()[-1]
    build = LlamaCppRunner.prepare(ModelRef("smollm2-135m", smollm2.hf_dir, smollm2.gguf_path),
                                   "original")
    with Worker([core], LlamaCppRunner.child_env([core], 1, {}), label="pin-llama") as w:
        facts = w.request("load", engine="llama.cpp", build=build.to_dict(), threads=1,
                          n_ctx=64)["facts"]
        w.request("tg", n=2, seed=0)  # start the thread pool
        tasks = w.request("affinity")["tasks"]
    assert facts["cores"] == [core] and facts["thread_cores"] == [core]
    assert all(aff == [core] for aff in tasks.values())


def test_comparable_setups_pass_and_misconfigured_ones_are_refused():
    same = {"cores": [0, 1], "threads": 2, "prefix_caching": False}
    check_comparable({"ours:w4a16": same, "llama.cpp:q4_k_m": dict(same)})
    for key, bad in (("threads", 1), ("cores", [0]), ("prefix_caching", True)):
        with pytest.raises(ComparisonRefused, match=key):
            check_comparable({"ours:w4a16": same, "llama.cpp:q4_k_m": {**same, key: bad}})


def test_cli_refuses_a_misconfigured_pair(tmp_path, edge_home):
    # Refused from the plan, before any guard sampling, build or engine load.
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    for spec in ("llama.cpp:q4_0,llama.cpp:q4_k_m@threads=1",
                 "ours:bf16@prefix_caching=on,ours:w4a16"):
        res = cli("bench", "run", "-m", str(tmp_path / "m"), "-e", spec, "--no-results",
                  timeout=300)
        assert res.returncode == 4, res.stderr
        assert "misconfigured comparison" in res.stderr


def test_lock_refuses_a_second_benchmark(edge_home):
    with bench_lock():
        res = cli("bench", "ceiling", "--no-results", "--force", "--gib", "0.05",
                  "--passes", "1", timeout=300)
    assert res.returncode != 0
    assert "another benchmark holds" in res.stderr
    assert f"pid {os.getpid()}" in res.stderr


def test_worker_reports_child_errors():
    with Worker(physical_cores()[:1], label="err-test") as w:
        with pytest.raises(Exception, match="unknown command"):
            w.request("no-such-command")
        assert w.request("affinity")["ok"]  # still serving after an error


def test_largest_cache_reads_each_unit(tmp_path):
    cache = tmp_path / "cpu0" / "cache"
    for i, size in enumerate(["48K", "2048K", "266240K"]):
        (cache / f"index{i}").mkdir(parents=True)
        (cache / f"index{i}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(0, tmp_path) == 266240 << 10
    assert largest_cache_bytes(1, tmp_path) == 0
