"""`bench fleet` and `bench merge`: a real local Ray cluster (a head and one worker node, each
offering one fake CPU kind) runs two tiny bench tasks and the records merge into one table;
merge's ratios stay within a machine; the fleet's Kubernetes Jobs validate against the
Kubernetes schemas and equal what their command writes."""

import shlex
import sys
from pathlib import Path

import pytest

from edge_harness.bench import fleet, merge
from edge_harness.record import Record, append_record
from edge_infer.api import UsageError, fingerprint
from edge_infer.cli import main

ROOT = Path(__file__).resolve().parents[3]
FLEET_JOBS = ROOT / "deploy" / "k8s" / "bench-fleet"
# the smallest bench task that writes a real record: a streaming-read ceiling over 16 MiB
TINY = ["ceiling", "--gib", "0.015625", "--passes", "1", "--window", "0.1", "--force",
        "--lock-wait", "120"]


@pytest.fixture(scope="module")
def ray_cluster(edge_home):
    """Head + one worker node (two raylets on this machine), kinds fake-a and fake-b. Started
    after edge_home: the nodes' workers inherit its private home and bench lock."""
    pytest.importorskip("ray", reason="ray is not installed (edge-infer-harness pins it)")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {fleet.resource("fake-a"): 1}, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1, resources={fleet.resource("fake-b"): 1})
    cluster.wait_for_nodes()
    try:
        yield cluster, {"fake-a": cluster.head_node.node_id, "fake-b": worker.node_id}
    finally:
        cluster.shutdown()


def test_two_kinds_run_on_their_nodes_and_merge(ray_cluster, tmp_path):
    cluster, node_of = ray_cluster
    said = []
    outcomes = fleet.submit(["fake-a", "fake-b"], TINY, tmp_path, cluster.address, timeout=120,
                            say=said.append)
    by_kind = {o["kind"]: o for o in outcomes}
    assert set(by_kind) == {"fake-a", "fake-b"}, said
    for kind, o in by_kind.items():
        assert o["ok"], f"{kind}: {o.get('error')}"
        assert o["node_id"] == node_of[kind]  # the custom resource chose the node
        assert (tmp_path / f"{kind}.jsonl").is_file()

    records = merge.collect([tmp_path])
    assert sorted(r.extra["fleet"]["kind"] for r in records) == ["fake-a", "fake-b"]
    here = fingerprint()
    for r in records:  # each task's records carry the fingerprint of the machine it ran on
        assert r.test == "ceiling" and r.unit == "GB/s" and r.median > 0
        assert (r.cpu_model, r.isa, r.cpu_flags) == (here["cpu_model"], here["isa"], here["cpu_flags"])
    # both nodes are this one CPU: one machine in the table, answering as both kinds
    (machine,) = merge.machines(records)
    assert machine[0] == merge.machine_id(records[0]) and machine[3] == "fake-a, fake-b"
    assert machine[5] == "2"


def test_a_kind_no_node_offers_is_refused_before_submitting(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    with pytest.raises(UsageError, match="no node of the Ray cluster offers cpu-kind-amx") as err:
        fleet.submit(["fake-a", "amx"], TINY, tmp_path, cluster.address)
    assert "\n" not in str(err.value) and "fake-a" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_a_failing_task_is_reported_not_merged(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    bad = ["ceiling", "--cores", "999", "--force"]  # refused at once by the task's own CLI
    (outcome,) = fleet.submit(["fake-b"], bad, tmp_path, cluster.address, timeout=120, say=print)
    assert not outcome["ok"] and outcome["returncode"] == 2
    assert "--cores 999" in outcome["error"]
    assert not (tmp_path / "fake-b.jsonl").exists()


@pytest.mark.parametrize("kinds, args, message", [
    ([], ["run"], "no --kind given"),
    (["amx", "amx"], ["run"], "lists a kind twice"),
    (["a/b"], ["run"], "use letters, digits"),
    (["amx"], ["report"], "a bench action that records"),
    (["amx"], ["run", "--results=x.jsonl"], "--results: the fleet chooses"),
])
def test_bad_plans_are_one_line_errors(kinds, args, message):
    with pytest.raises(UsageError, match=message) as err:
        fleet.check_plan(kinds, args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, models", [
    (["run"], ["smollm2-135m"]),  # bench run's default model
    (["run", "-m", "smollm2-135m,qwen3-0.6b-random", "--model=smollm2-135m"],
     ["smollm2-135m", "qwen3-0.6b-random"]),
    (["gemm", "-mqwen3-0.6b-random", "-m", "/some/hf-folder"], ["qwen3-0.6b-random"]),
    (["ceiling", "--gib", "1"], []),
])
def test_each_task_pulls_the_registry_models_it_reads(args, models):
    assert fleet.models_of(args) == models


# -- merge: rows by fingerprint, ratios within a machine -------------------------------------
def _rec(cpu: str, isa: str, engine: str, quant: str, tok_s: float, test: str = "tg128") -> Record:
    return Record(engine=engine, engine_version="v", model="m", quant=quant, test=test,
                  samples=[tok_s], threads=2, cpu_model=cpu, isa=isa, cpu_flags=[isa])


def test_merge_takes_ratios_only_within_a_machine(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    append_record(a, _rec("Zen 3", "avx2", "llama.cpp", "q4_k_m", 20.0))
    append_record(a, _rec("Zen 3", "avx2", "ours", "w4a16", 30.0))
    append_record(b, _rec("Sapphire Rapids", "amx", "ours", "w4a16", 90.0))  # no baseline here
    append_record(b, _rec("Sapphire Rapids", "amx", "llama.cpp", "q4_k_m", 60.0, test="pp512"))
    rows = merge.rows(merge.collect([a, b]), "llama.cpp:q4_k_m")
    ratio = {(x.record.cpu_model, x.build, x.record.test): x.ratio for x in rows}
    assert ratio[("Zen 3", "ours:w4a16", "tg128")] == pytest.approx(1.5)
    assert ratio[("Zen 3", "llama.cpp:q4_k_m", "tg128")] == pytest.approx(1.0)
    # the AMX box's ours has no llama.cpp tg128 of its own: no ratio, never one against Zen 3's
    assert ratio[("Sapphire Rapids", "ours:w4a16", "tg128")] is None
    assert len({x.machine for x in rows}) == 2


def test_merge_keeps_the_newest_record_per_machine(tmp_path):
    f = tmp_path / "r.jsonl"
    append_record(f, _rec("Zen 3", "avx2", "ours", "w4a16", 10.0))
    append_record(f, _rec("Zen 3", "avx2", "ours", "w4a16", 12.0))
    (row,) = merge.rows(merge.collect([f]), None)
    assert row.record.median == 12.0


def test_merge_cli_prints_both_machines_and_refuses_an_empty_folder(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    append_record(f, _rec("Zen 3", "avx2", "ours", "w4a16", 30.0))
    append_record(f, _rec("Sapphire Rapids", "amx", "ours", "w4a16", 90.0))
    assert main(["bench", "merge", str(f), "-o", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and {ln.split(",")[1] for ln in lines[1:]} == {"Zen 3", "Sapphire Rapids"}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no \\*.jsonl records"):
        merge.collect([empty])


# -- the same plan as Kubernetes Jobs --------------------------------------------------------
def test_committed_fleet_jobs_equal_what_their_command_writes(tmp_path, monkeypatch):
    """deploy/k8s/bench-fleet is generated: its header names the command; run that command
    in a scratch folder and the files must come out the same."""
    head = (FLEET_JOBS / "kustomization.yaml").read_text().splitlines()[0]
    command = head.split("`")[1]
    argv = shlex.split(command)
    assert argv[:3] == ["edge-infer", "bench", "fleet"] and "--kubernetes" in argv
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", argv)
    assert main(argv[1:]) == 0
    made = tmp_path / "deploy" / "k8s" / "bench-fleet"
    names = sorted(p.name for p in FLEET_JOBS.iterdir())
    assert names == sorted(p.name for p in made.iterdir())
    for name in names:
        assert (made / name).read_text() == (FLEET_JOBS / name).read_text(), name


def test_fleet_jobs_validate_and_pin_their_cpu_kind(tmp_path):
    from deploy_manifests import documents, validate

    paths = fleet.write_jobs(list(fleet.KINDS), ["run", "-m", "smollm2-135m"], tmp_path,
                             "edge-infer-harness:latest", 2, "edge-infer bench fleet ...")
    for path in paths:
        (job,) = documents(path)
        validate(job, path)
        kind = job["metadata"]["labels"]["edge-infer/cpu-kind"]
        spec = job["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        exprs = {e["key"]: e for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
        if kind == "amx":
            assert exprs[fleet.NFD + "AMXTILE"]["values"] == ["true"]
        if kind == "avx2":  # an AVX-512 box has AVX2 too: it must be kept out
            assert exprs[fleet.NFD + "AVX512F"]["operator"] == "DoesNotExist"
        *pulls, bench = spec["initContainers"]
        assert [p["args"] for p in pulls] == [["models", "pull", "smollm2-135m"]]
        home = {e["name"]: e["value"] for e in bench["env"]}["EDGE_INFER_HOME"]
        for c in (*pulls, bench):  # the pulled model is where the benchmark looks
            assert home in [m["mountPath"] for m in c["volumeMounts"]]
        assert bench["args"][:2] == ["bench", "run"] and bench["args"][-2] == "--results"
        assert bench["resources"]["requests"] == bench["resources"]["limits"]
        assert spec["containers"][0]["command"] == ["cat", bench["args"][-1]]
    with pytest.raises(UsageError, match="know the NFD labels of"):
        fleet.write_jobs(["fake-a"], ["run"], tmp_path, "img", 2, "c")
