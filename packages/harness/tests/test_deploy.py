"""deploy/: the Kubernetes manifests validate offline against the Kubernetes schemas and agree
with the engine image (port, probes, key, cores); the compose stack's load balancer retries
what it may. Static checks: nothing here starts a container (`nox -s deploy-compose` does)."""

import re
from pathlib import Path

import pytest
import yaml
from deploy_manifests import (
    documents,
    kustomization,
    kustomize_binary,
    render,
    render_with_binary,
    validate,
)

from edge_infer.serve.auth import KEY_ENV, OPEN

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
ENGINE_IMAGE = ROOT / "docker" / "engine.Dockerfile"
# every folder with a kustomization: the base, the optional HPA overlay, the fleet's Jobs
BUILDS = ["base", "overlays/hpa", "bench-fleet"]


def _port_of_image() -> int:
    (port,) = re.findall(r"^EXPOSE (\d+)$", ENGINE_IMAGE.read_text(), re.M)
    return int(port)


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("folder", sorted({p.parent for p in K8S.rglob("kustomization.yaml")}),
                         ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_listed_and_valid(folder):
    k = kustomization(folder)
    listed = {r for r in k.get("resources", []) if (folder / r).is_file()}
    on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"{folder}: files not in its kustomization, or missing: {listed ^ on_disk}"
    for name in sorted(on_disk):
        for doc in documents(folder / name):
            validate(doc, folder / name)


@pytest.mark.parametrize("build", BUILDS)
def test_rendered_builds_validate(build):
    docs = render(K8S / build)
    assert docs
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(set(names)) == len(names), f"{build}: a resource twice: {names}"
    for doc in docs:
        validate(doc, f"kustomize build {build}")


@pytest.mark.parametrize("build", BUILDS)
def test_our_rendering_equals_kustomize(build):
    """Where a kustomize binary exists (kubectl has one), it renders what the test renderer
    does, so the validated documents are the ones a cluster would get."""
    if kustomize_binary() is None:
        pytest.skip("no kustomize or kubectl on PATH: only the built-in renderer was checked")
    ours = {(d["kind"], d["metadata"]["name"]): d for d in render(K8S / build)}
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in render_with_binary(K8S / build)}
    assert ours == theirs


def test_deployment_serves_the_image_as_it_expects():
    docs = _by_kind(render(K8S / "base"))
    dep, svc, pdb = docs["Deployment"], docs["Service"], docs["PodDisruptionBudget"]
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    port = _port_of_image()
    assert c["ports"][0]["containerPort"] == port and c["ports"][0]["name"] == "http"
    assert c["args"][0] == "serve"  # the image's entrypoint is `edge-infer`
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["path"] in OPEN and get["port"] == "http"
    env = {e["name"]: e for e in c["env"]}
    assert env[KEY_ENV]["valueFrom"]["secretKeyRef"]["name"] == "edge-infer-api-key"
    # threads follow the CPU limit (Downward API), expanded in args by the kubelet
    assert "$(EDGE_INFER_THREADS)" in c["args"]
    assert env["EDGE_INFER_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    res = c["resources"]
    assert res["requests"] == res["limits"], "Guaranteed QoS: requests must equal limits"
    assert re.fullmatch(r"[1-9]\d*", str(res["limits"]["cpu"])), "whole cores for the static CPU manager"
    labels = pod["metadata"]["labels"]
    for selector in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]


def test_hpa_overlay_scales_on_vllm_queue_and_opens_metrics():
    docs = _by_kind(render(K8S / "overlays" / "hpa"))
    hpa, dep = docs["HorizontalPodAutoscaler"], docs["Deployment"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert "--metrics-open" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert hpa["spec"]["minReplicas"] >= 2


# -- compose + HAProxy -------------------------------------------------------------------------
COMPOSE = ROOT / "deploy" / "compose.yaml"
HAPROXY = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


def test_compose_runs_two_replicas_behind_haproxy():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    replicas = [s for s in services.values() if s.get("image", "").startswith("edge-infer:")]
    assert len(replicas) == 2
    for s in replicas:
        assert s["healthcheck"]["test"], "each replica has a health check"
        assert "ports" not in s, "replicas are reached through the load balancer only"
    lb = services["lb"]
    assert lb["build"]["dockerfile"].endswith("haproxy.Containerfile")
    cfg = HAPROXY.read_text()
    servers = re.findall(r"^\s*server (\S+) (\S+):(\d+) .*check", cfg, re.M)
    assert {host for _, host, _ in servers} == set(k for k, v in services.items() if v in replicas)
    assert {int(p) for *_, p in servers} == {_port_of_image()}
    assert re.search(r"^\s*option httpchk GET /health", cfg, re.M)
    assert re.search(r"^\s*retries \d+", cfg, re.M)
    assert re.search(r"^\s*option redispatch", cfg, re.M)
    # retry only where the request cannot have reached a replica: a POST is not idempotent
    # (empty-response or response-timeout would resend a completion a replica had started)
    (retry_on,) = re.findall(r"^\s*retry-on (.+)$", cfg, re.M)
    assert retry_on.split() == ["conn-failure"]
