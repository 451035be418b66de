"""`edge-infer bench fleet`: one benchmark plan measured on several CPU kinds, by engines that
already exist: Ray tasks on a Ray cluster the user runs, or Kubernetes Jobs on nodes labelled
by node-feature-discovery. Nothing here schedules; it only says where each task may run.

A CPU kind is a name (avx2, amx, ...). On Ray it is a custom resource, `cpu-kind-NAME`, that
each node of that kind is started with (`ray start --resources '{"cpu-kind-amx": 1}'`); one
unit per node keeps benchmarks on one machine one at a time, as the bench lock does locally.
On Kubernetes it is a node affinity on NFD's CPU labels (KINDS).

Each task pulls the registry models it names (`edge-infer models pull`), then runs
`edge-infer bench ACTION ... --results FILE` on its node, and sends the records
back; they carry the node's CPU fingerprint (cpu_model, isa, cpu_flags), as every Record does,
and `extra.fleet` says which kind was asked for and which node answered. `bench merge` reads
them back into one table.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edge_harness.record import Record, append_record, read_records
from edge_infer.api import UsageError

RESOURCE_PREFIX = "cpu-kind-"
# Bench actions that measure and append records; the fleet gives each its --results file.
ACTIONS = ("run", "ceiling", "gemm")
NFD = "feature.node.kubernetes.io/cpu-cpuid."
ARCH = "kubernetes.io/arch"


@dataclass(frozen=True)
class Kind:
    """A CPU kind as node-feature-discovery labels it: labels the node must have, and labels
    it must not have (an AMX box also has AVX-512 and AVX2: "avx2" means AVX2 without more)."""

    help: str
    has: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()
    arch: str = "amd64"


KINDS = {
    "avx2": Kind("x86-64 with AVX2, no AVX-512 (e.g. AMD Zen 3)", ("AVX2",), ("AVX512F",)),
    "avx512": Kind("AVX-512 without AMX (e.g. Intel Ice Lake, AMD Zen 4)", ("AVX512F",),
                   ("AMXTILE",)),
    "amx": Kind("AMX tiles (Intel Sapphire Rapids and later)", ("AMXTILE",)),
    "arm64": Kind("64-bit Arm (e.g. Graviton, Ampere)", arch="arm64"),
}


def resource(kind: str) -> str:
    return RESOURCE_PREFIX + kind


def check_plan(kinds: list[str], bench_args: list[str]) -> None:
    """One-line refusals of a plan that cannot run, before anything is submitted."""
    if not kinds:
        raise UsageError("no --kind given: name the CPU kinds to measure, e.g. --kind avx2 --kind amx")
    if len(set(kinds)) != len(kinds):
        raise UsageError(f"--kind lists a kind twice: {kinds}")
    for k in kinds:
        if not k or not all(c.isalnum() or c in "-_" for c in k):
            raise UsageError(f"--kind {k!r}: use letters, digits, '-' and '_'")
    if not bench_args or bench_args[0] not in ACTIONS:
        got = bench_args[0] if bench_args else "nothing"
        raise UsageError(f"after --, a bench action that records: {', '.join(ACTIONS)} (got {got}), "
                         "e.g. `bench fleet --kind avx2 -- run -m smollm2-135m`")
    taken = {"--results", "--no-results"} & {a.split("=")[0] for a in bench_args}
    if taken:
        raise UsageError(f"{', '.join(sorted(taken))}: the fleet chooses where each task's "
                         "records go (--out on this machine)")


DEFAULT_MODEL = "smollm2-135m"  # bench run's and gemm's default -m


def models_of(bench_args: list[str]) -> list[str]:
    """The registry models a bench action will read (-m/--model, comma lists, repeated; the
    action's default when none): each task pulls them first, as a fresh node has none."""
    from edge_infer.api import REGISTRY

    if bench_args[0] == "ceiling":
        return []
    named: list[str] = []
    args = iter(bench_args[1:])
    for a in args:
        if a in ("-m", "--model"):
            named += next(args, "").split(",")
        elif a.startswith("--model="):
            named += a.split("=", 1)[1].split(",")
        elif a.startswith("-m") and len(a) > 2:
            named += a[2:].split(",")
    named = [m.strip() for m in named if m.strip()] or [DEFAULT_MODEL]
    return [m for m in dict.fromkeys(named) if m in REGISTRY]  # a folder is the node's own


# -- one task, on the node Ray chose ---------------------------------------------------------
def run_task(kind: str, bench_args: list[str], entry: list[str] | None = None) -> dict:
    """Run `edge-infer bench ARGS --results FILE` here; the records, tagged with the kind and
    this node, or the failure. Runs on a fleet node (a Ray task), so it returns rather than
    raises: the driver reports every kind's outcome together."""
    node = {"kind": kind, "hostname": socket.gethostname(), "node_id": _ray_node_id()}
    entry = entry or [sys.executable, "-m", "edge_infer"]
    with tempfile.TemporaryDirectory(prefix="edge-fleet-") as tmp:
        out = Path(tmp) / "records.jsonl"
        steps = [[*entry, "models", "pull", m] for m in models_of(bench_args)]
        steps.append([*entry, "bench", *bench_args, "--results", str(out)])
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                return {**node, "ok": False, "returncode": proc.returncode,
                        "error": f"{' '.join(cmd[len(entry):])}: " + "\n".join(tail)}
        records = read_records(out, kind=None) if out.is_file() else []
    dicts = []
    for r in records:
        r.extra = {**r.extra, "fleet": node}
        dicts.append(r.to_dict())
    return {**node, "ok": True, "records": dicts}


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


# -- the driver -------------------------------------------------------------------------------
def submit(kinds: list[str], bench_args: list[str], out: Path, address: str | None = None,
           timeout: float | None = None, say=print) -> list[dict]:
    """Submit one task per kind to the Ray cluster at `address` (default: RAY_ADDRESS, else the
    cluster this machine belongs to), wait for all, append each kind's records to
    OUT/KIND.jsonl. Returns the outcomes; raises UsageError when no node offers a kind."""
    check_plan(kinds, bench_args)
    try:
        import ray
    except ImportError:
        raise UsageError("bench fleet needs Ray on this machine and on every node: "
                         "install edge-infer-harness (it pins ray)") from None
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    _reachable(address)
    try:
        ray.init(address=address, logging_level="warning", log_to_driver=False)
    except ConnectionError as exc:
        raise UsageError(f"no Ray cluster at {address} ({exc}); start one with `ray start --head` "
                         "or pass --address HOST:6379") from None
    try:
        offered = ray.cluster_resources()
        missing = [k for k in kinds if offered.get(resource(k), 0) < 1]
        if missing:
            have = sorted(r.removeprefix(RESOURCE_PREFIX) for r in offered if r.startswith(RESOURCE_PREFIX))
            raise UsageError(
                f"no node of the Ray cluster offers {', '.join(resource(k) for k in missing)} "
                f"(kinds there: {', '.join(have) or 'none'}); start a node of that kind with "
                f"`ray start --address ... --resources '{{\"{resource(missing[0])}\": 1}}'`")
        task = ray.remote(run_task)
        pending = {task.options(resources={resource(k): 1}, num_cpus=0, max_retries=0,
                                name=f"edge-infer-bench-{k}").remote(k, bench_args): k
                   for k in kinds}
        say(f"fleet: {len(pending)} task(s) submitted to {address}: {', '.join(kinds)}")
        outcomes = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not done:
                late = ", ".join(pending.values())
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise UsageError(f"bench fleet: no answer within {timeout:g} s from {late}")
            ref = done[0]
            kind = pending.pop(ref)
            outcome = ray.get(ref)
            outcomes.append(outcome)
            if outcome["ok"]:
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"{kind}.jsonl"
                for d in outcome["records"]:
                    append_record(path, Record.from_dict(d))
                say(f"fleet: {kind} on {outcome['hostname']}: {len(outcome['records'])} record(s) "
                    f"-> {path}")
            else:
                say(f"fleet: {kind} on {outcome['hostname']} FAILED (exit {outcome['returncode']}): "
                    f"{outcome['error']}")
        return outcomes
    finally:
        ray.shutdown()


def _reachable(address: str) -> None:
    """Refuse an address nothing listens on at once: ray.init retries such a one for minutes,
    printing a warning every few seconds. ("auto" finds the local cluster or fails at once.)"""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--address {address!r}: expected HOST:PORT (e.g. 10.0.0.5:6379) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise UsageError(f"--address {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                         "start one with `ray start --head`, or pass the head's HOST:PORT") from None


# -- the same plan as Kubernetes Jobs ---------------------------------------------------------
def job(kind: str, bench_args: list[str], image: str, cpus: int) -> dict:
    """A Job measuring on one node of `kind`: init containers pull the models and run the
    benchmark into an emptyDir, then the `records` container prints the records, so
    `kubectl logs job/NAME -c records > KIND.jsonl` collects exactly them."""
    k = KINDS[kind]
    match = [{"key": ARCH, "operator": "In", "values": [k.arch]}]
    match += [{"key": NFD + flag, "operator": "In", "values": ["true"]} for flag in k.has]
    match += [{"key": NFD + flag, "operator": "DoesNotExist"} for flag in k.lacks]
    name = f"edge-infer-bench-{kind}"
    labels = {"app.kubernetes.io/name": "edge-infer-bench", "edge-infer/cpu-kind": kind}
    results = "/results/records.jsonl"
    cpu = str(cpus)
    # requests == limits in whole cores: a static CPU manager gives the benchmark cores of its
    # own; the guard in `bench run` still refuses to measure while they are busy.
    resources = {"requests": {"cpu": cpu, "memory": "8Gi"}, "limits": {"cpu": cpu, "memory": "8Gi"}}
    security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    mount = [{"name": "results", "mountPath": "/results"}]
    # models are pulled into the pod's own EDGE_INFER_HOME first (the image has none), one
    # init container per model, then the benchmark reads them from there
    home = [{"name": "EDGE_INFER_HOME", "value": "/edge-home"}]
    home_mount = [{"name": "edge-home", "mountPath": "/edge-home"}]
    pulls = [{"name": f"pull-{i}", "image": image, "args": ["models", "pull", m], "env": home,
              "resources": resources, "securityContext": security, "volumeMounts": home_mount}
             for i, m in enumerate(models_of(bench_args))]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "backoffLimit": 0,  # a failed measurement is reported, not retried into a number
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": match}]}}},
                    "initContainers": [*pulls, {
                        "name": "bench", "image": image,
                        "args": ["bench", *bench_args, "--results", results], "env": home,
                        "resources": resources, "securityContext": security,
                        "volumeMounts": mount + home_mount,
                    }],
                    "containers": [{
                        "name": "records", "image": image,
                        "command": ["cat", results],
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                                      "limits": {"cpu": "100m", "memory": "64Mi"}},
                        "securityContext": security, "volumeMounts": mount,
                    }],
                    "volumes": [{"name": "results", "emptyDir": {}}, {"name": "edge-home", "emptyDir": {}}],
                },
            },
        },
    }


def write_jobs(kinds: list[str], bench_args: list[str], out: Path, image: str, cpus: int,
               command: str) -> list[Path]:
    """One Job manifest per kind in OUT, plus a kustomization.yaml listing them."""
    import json

    import yaml

    def dump(obj: dict) -> str:  # through JSON: no YAML anchors for the dicts used twice
        return yaml.safe_dump(json.loads(json.dumps(obj)), sort_keys=False)

    check_plan(kinds, bench_args)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UsageError(f"--kind {', '.join(unknown)}: Kubernetes Jobs know the NFD labels of "
                         f"{', '.join(KINDS)} only")
    if cpus < 1:
        raise UsageError(f"--cpus {cpus}: whole cores, at least 1")
    out.mkdir(parents=True, exist_ok=True)
    head = f"# Generated by `{command}`: edit the command, not this file.\n"
    paths = []
    for kind in kinds:
        path = out / f"bench-{kind}.yaml"
        path.write_text(head + f"# {KINDS[kind].help}\n"
                        + dump(job(kind, bench_args, image, cpus)))
        paths.append(path)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [p.name for p in paths]}
    (out / "kustomization.yaml").write_text(head + dump(kustomization))
    return paths
