"""The one result record of the harness, its statistics, and its append-only JSONL file.

Every measurement (a pp/tg test of one engine build, a bandwidth ceiling, a GEMM shape) is
one `Record`; printers (report.printers) and the report renderer read only these fields.
`samples` are the per-repetition throughputs in `unit`; `mean`, `sd` (sample standard
deviation, n-1, as llama-bench's stdev) and `median` are derived from them.

Records are appended to a JSONL file by the engine's one record append (edge_infer.api.append:
one line per write, fsynced): a run killed at any moment leaves every record it finished whole.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_infer.api import append, read, utc_now

SCHEMA = 1


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
    cpu_id: str = ""  # vendor family/model/stepping: names the generation a VM's model hides
    isa: str = ""
    cpu_flags: list[str] = field(default_factory=list)
    guard: str = "ok"  # "ok" | "overridden" (--force while the guard saw foreign load)
    guard_foreign_load: float | None = None  # worst foreign load seen, fraction of one core
    # What the guard judged (edge_infer.api.Verdict): the worst mean over one measurement,
    # the worst one core over a sub-window, against the threshold; None in older records.
    guard_mean_load: float | None = None
    guard_peak_load: float | None = None
    guard_threshold: float | None = None
    guard_window: float | None = None  # seconds sampled before each measurement
    guard_sub_window: float | None = None  # seconds per sample during one
    guard_peak_window: float | None = None  # seconds the peak was judged over (>= 1% of the run)
    guard_remeasured: int | None = None  # measurements retaken for foreign load (guard.REMEASURE)
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
            self.timestamp = utc_now()

    def against_ceiling(self, gbs: float) -> None:
        """Set ceiling_gbs and pct_ceiling: achieved_gbs against a streaming ceiling of `gbs`
        (GB/s), measured on the same cores."""
        self.ceiling_gbs = round(gbs, 3)
        self.pct_ceiling = round(100 * self.achieved_gbs / self.ceiling_gbs, 2)

    @property
    def build(self) -> str:
        """The quant with the build's options, as `-e` spells them (`w4a8-head@act_dtype=bfloat16`):
        a variant of a build is another measurement, never the build itself."""
        options = self.extra.get("options") or {}
        return self.quant + "".join(f"@{k}={v}" for k, v in sorted(options.items()))

    @property
    def key(self) -> tuple:
        """What a newer record of the same measurement replaces in a report."""
        return (self.model, self.engine, self.build, self.test, self.threads)

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
    append(path, record.to_dict())


def read_records(path: Path, kind: str | None = "bench") -> list[Record]:
    """The records of `kind` in a JSONL file (all of them with kind None). A torn last line (a
    crash mid-write: no newline, not JSON) is skipped with a warning; a bad line anywhere else
    is an error."""
    records = read(path, Record.from_dict, what="harness record")
    return [r for r in records if kind is None or r.kind == kind]
