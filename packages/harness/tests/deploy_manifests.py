"""Kubernetes manifests for tests (a module, not conftest: no name clashes): read them, render a
kustomization without a kustomize binary, validate against the Kubernetes JSON schemas that the
PyPI package kubernetes-validate ships (offline).

The renderer knows the little deploy/k8s uses: `resources` (files and folders), `components`,
`images` (newName/newTag) and JSON6902 `patches` with add/replace. Anything else is an error,
so a kustomization that grows past it fails here instead of being half-rendered.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import yaml

# the oldest Kubernetes minor the manifests claim (policy/v1 PDB, autoscaling/v2 HPA: 1.23+),
# and the newest whose schemas the package ships
OLDEST = "1.29.0"
KNOWN_KEYS = {"apiVersion", "kind", "resources", "components", "images", "patches"}


def documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def validate(doc: dict, where: Path | str) -> None:
    """Strict schema validation (unknown fields are errors) at the oldest and newest versions."""
    import kubernetes_validate

    for version in (OLDEST, kubernetes_validate.latest_version()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = doc.get("metadata", {}).get("name")
            raise AssertionError(f"{where}: {doc.get('kind')} {name} is not valid Kubernetes "
                                 f"{version}: {exc.message}") from None


def kustomization(folder: Path) -> dict:
    data = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(data) - KNOWN_KEYS
    assert not unknown, f"{folder}: kustomization keys this renderer does not know: {unknown}"
    return data


def render(folder: Path) -> list[dict]:
    """What `kustomize build folder` gives, for the features listed above."""
    k = kustomization(folder)
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        docs += render(path) if path.is_dir() else copy.deepcopy(documents(path))
    for comp in k.get("components", []):
        c = kustomization(folder / comp)
        assert c["kind"] == "Component", f"{folder / comp}: not a kustomize Component"
        docs += [copy.deepcopy(d) for r in c.get("resources", []) for d in documents(folder / comp / r)]
        for patch in c.get("patches", []):
            _patch(docs, patch)
    for patch in k.get("patches", []):
        _patch(docs, patch)
    for image in k.get("images", []):
        for d in docs:
            for c in _containers(d):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
    return docs


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def _patch(docs: list[dict], patch: dict) -> None:
    target = patch["target"]
    hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
    assert hits, f"patch target {target} matches no resource"
    for op in yaml.safe_load(patch["patch"]):
        assert op["op"] in ("add", "replace"), f"patch op {op['op']} is not rendered here"
        for d in hits:
            *parents, last = op["path"].strip("/").split("/")
            node = d
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if isinstance(node, list):
                if last == "-":
                    node.append(op["value"])
                else:
                    node[int(last)] = op["value"]
            else:
                node[last] = op["value"]


def kustomize_binary() -> list[str] | None:
    """`kustomize build` or `kubectl kustomize`, when this machine has one (CI need not)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render_with_binary(folder: Path) -> list[dict]:
    cmd = kustomize_binary()
    assert cmd is not None
    out = subprocess.run([*cmd, str(folder)], capture_output=True, text=True, timeout=120, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]
