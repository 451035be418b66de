"""The on-disk store of pulled models: one folder per model, a manifest of checksums, atomic.

Layout of `<EDGE_INFER_HOME>/models/<name>/`:
    hf/             HF folder (config.json, *.safetensors, tokenizer, chat template)
    gguf/<file>     the original GGUF, for llama.cpp (GGUF-sourced models only)
    manifest.json   sha256 and size of every file above; written last

A model folder only ever appears by one rename of a fully written, fsynced folder
(edge_infer.atomic), so a killed pull leaves at most a `.<name>.partial-*` folder that nothing
loads and the next pull removes; `pull --force` swaps the new build in with no moment
without a model, and deletes the old one after.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from edge_infer import __version__
from edge_infer.atomic import build_beside
from edge_infer.errors import EdgeInferError
from edge_infer.home import models_dir
from edge_infer.models.registry import ModelSpec, get_spec

MANIFEST = "manifest.json"
CHUNK = 1 << 22


@dataclass(frozen=True)
class PulledModel:
    name: str
    root: Path

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    @property
    def gguf_path(self) -> Path | None:
        files = sorted((self.root / "gguf").glob("*.gguf"))
        return files[0] if files else None

    @property
    def manifest(self) -> dict:
        return read_manifest(self.root / MANIFEST, self.name)


def read_manifest(path: Path, name: str) -> dict:
    """The manifest, checked enough that verify and callers never meet a KeyError."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = str(exc)
    else:
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str)
            and isinstance(e.get("size"), int) for e in files.values()
        ):
            return manifest
        problem = "no table of files with sha256 and size"
    raise EdgeInferError(f"{path} is malformed ({problem}); rebuild the model: "
                         f"edge-infer models pull {name} --force")


def sha256_file(path: Path, progress: tqdm | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def model_path(name: str) -> PulledModel:
    """The pulled model, or a clear error saying how to get it."""
    get_spec(name)
    root = models_dir() / name
    if not (root / MANIFEST).is_file():
        raise EdgeInferError(
            f"model {name!r} is not pulled (looked in {root}); run: edge-infer models pull {name}"
        )
    return PulledModel(name, root)


def is_pulled(name: str) -> bool:
    return (models_dir() / name / MANIFEST).is_file()


def write_manifest(root: Path, spec: ModelSpec, extra: dict) -> dict:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    total = sum(p.stat().st_size for p in files)
    entries = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="checksums", leave=False) as bar:
        for p in files:
            entries[str(p.relative_to(root))] = {
                "sha256": sha256_file(p, bar),
                "size": p.stat().st_size,
            }
    manifest = {
        "name": spec.name,
        "description": spec.description,
        "arch": spec.arch,
        "license": spec.license,
        "edge_infer_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": entries,
        **extra,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify(name: str) -> list[str]:
    """Re-hash every file against the manifest; returns the problems (empty = intact)."""
    model = model_path(name)
    manifest = model.manifest
    problems = []
    listed = set(manifest["files"])
    on_disk = {
        str(p.relative_to(model.root))
        for p in model.root.rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    for rel in sorted(on_disk - listed):
        problems.append(f"{rel}: not in the manifest")
    total = sum(e["size"] for e in manifest["files"].values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {name}", leave=False) as bar:
        for rel, entry in sorted(manifest["files"].items()):
            path = model.root / rel
            if not path.is_file():
                problems.append(f"{rel}: missing")
                continue
            if path.stat().st_size != entry["size"]:
                problems.append(f"{rel}: size {path.stat().st_size} != {entry['size']}")
                bar.update(entry["size"])
                continue
            if sha256_file(path, bar) != entry["sha256"]:
                problems.append(f"{rel}: sha256 differs from the manifest (corrupted)")
    return problems


def check_free_space(where: Path, need_bytes: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < need_bytes:
        raise EdgeInferError(
            f"not enough disk space in {where}: {free / 2**30:.1f} GiB free, "
            f"~{need_bytes / 2**30:.1f} GiB needed; free some space or set EDGE_INFER_HOME"
        )


@contextlib.contextmanager
def staging(name: str) -> Iterator[Path]:
    """A private folder to build `name` in; on success it atomically becomes the model folder."""
    base = models_dir()
    try:
        with build_beside(base / name) as tmp:
            # what pulls killed before edge_infer.atomic left (same lock file, so none is live)
            for stale in base.glob(f".staging-{name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            yield tmp
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise EdgeInferError(
                f"disk full while building {name!r} in {base}; free space or set "
                "EDGE_INFER_HOME to a larger disk (nothing half-written was kept)"
            ) from exc
        raise
