"""The one result record of the harness, its statistics, and its append-only JSONL file.

Every measurement (a pp/tg test of one engine build, a bandwidth ceiling, a GEMM shape) is
one `Record`; printers (report.printers) and the report renderer read only these fields.
`samples` are the per-repetition throughputs in `unit`; `mean`, `sd` (sample standard
deviation, n-1, as llama-bench's stdev) and `median` are derived from them.

Records are appended to a JSONL file one line per `os.write` on an `O_APPEND` descriptor and
fsynced: a run killed at any moment leaves every record it finished whole and parseable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1

log = logging.getLogger(__name__)


@dataclass
class Record:
    engine: str  # "ours", "llama.cpp", "torch", "numpy" (ceiling), a kernel name (gemm)
    engine_version: str
    model: str
    quant: str  # "w4a16", "bf16", "q4_k_m", ...
    test: str  # "pp512", "tg128", "ceiling", "gemm_m1_qkv_proj", ...
    samples: list[float]
    unit: str = "tok/s"
    bits_per_weight: float | None = None
    n_prompt: int = 0
    n_gen: int = 0
    threads: int = 0
    cores: list[int] = field(default_factory=list)
    cpu_model: str = ""
    isa: str = ""
    cpu_flags: list[str] = field(default_factory=list)
    guard: str = "ok"  # "ok" | "overridden" (--force while the guard saw foreign load)
    guard_foreign_load: float | None = None  # worst foreign load seen, fraction of one core
    # What the guard judged (isolation.guard.Verdict): the worst mean over one measurement,
    # the worst one core over a sub-window, against the threshold; None in older records.
    guard_mean_load: float | None = None
    guard_peak_load: float | None = None
    guard_threshold: float | None = None
    guard_window: float | None = None  # seconds sampled before each measurement
    guard_sub_window: float | None = None  # seconds per sample during one
    # Roofline (decode tests): weight bytes read per token x tok/s, against the ceiling.
    weight_bytes_per_token: int | None = None
    achieved_gbs: float | None = None
    ceiling_gbs: float | None = None
    pct_ceiling: float | None = None
    run_id: str = ""
    git_commit: str | None = None
    git_dirty: bool | None = None
    timestamp: str = ""
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # "bench" (the speed tables), or a check kept beside them that reports leave out, e.g.
    # "llama_bench_crosscheck" (bench/crosscheck.py); absent in older records: "bench".
    kind: str = "bench"
    schema: int = SCHEMA
    # derived from samples in __post_init__
    mean: float = 0.0
    sd: float = 0.0
    median: float = 0.0

    def __post_init__(self) -> None:
        self.samples = [float(s) for s in self.samples]
        self.mean, self.sd, self.median = summarize(self.samples)
        if not self.timestamp:
            self.timestamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    @property
    def key(self) -> tuple:
        """What a newer record of the same measurement replaces in a report."""
        return (self.model, self.engine, self.quant, self.test, self.threads)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        known = {f.name for f in dataclasses.fields(cls)}
        derived = {"mean", "sd", "median"}
        return cls(**{k: v for k, v in d.items() if k in known and k not in derived})


def summarize(samples: list[float]) -> tuple[float, float, float]:
    """(mean, sample sd, median); sd is 0 for a single sample, NaN-free."""
    if not samples:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(samples)
    sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return mean, sd, statistics.median(samples)


def append_record(path: Path, record: Record) -> None:
    """Append one record as one line, atomically with respect to kills and other appenders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record.to_dict(), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        torn = _torn_tail(fd, end)
        if torn:  # a line left without its newline by a crash: cut it before appending
            log.warning("%s: dropping a torn last line (%d bytes) before appending", path, torn)
            end -= torn
            os.ftruncate(fd, end)
        # One write() of the whole line: O_APPEND places it at the end in one step, so a
        # kill leaves either the whole line or none of it (never half a JSON object).
        written = os.write(fd, line)
        if written != len(line):  # only on a full disk: take the fragment back, and say so
            os.ftruncate(fd, end)
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes (truncated back)")
        os.fsync(fd)
    finally:
        os.close(fd)


def _torn_tail(fd: int, end: int) -> int:
    """Bytes after the last newline of the file (0 when it ends with one, or is empty)."""
    size = 0
    while end - size > 0:
        step = min(4096, end - size)
        chunk = os.pread(fd, step, end - size - step)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return size + step - cut - 1
        size += step
    return size


def read_records(path: Path, kind: str | None = "bench") -> list[Record]:
    """The records of `kind` in a JSONL file (all of them with kind None). A torn last line (a
    crash mid-write: no newline, not JSON) is skipped with a warning; a bad line anywhere else
    is an error."""
    records = []
    path = Path(path)
    text = path.read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = Record.from_dict(json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            if i == len(lines) and not text.endswith("\n"):
                log.warning("%s:%d: skipping a torn last line (%s)", path, i, exc)
                continue
            raise ValueError(f"{path}:{i}: not a harness record ({exc})") from None
        if kind is None or record.kind == kind:
            records.append(record)
    return records


def git_state(cwd: Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the working tree we run from; (None, None) outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=30,
        )
        return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return None, None
