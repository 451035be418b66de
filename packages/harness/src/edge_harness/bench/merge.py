"""`edge-infer bench merge`: records from many machines in one table.

Rows are grouped by machine, and a machine is its CPU fingerprint (model, ISA level, flags:
what every Record carries), not the name a fleet gave its kind: two nodes of one kind with
different CPUs stay apart. Ratios against the baseline build are taken only within a machine
(same fingerprint, model, test and threads); across machines a ratio would mix the CPUs'
speeds with the engines', so the table never prints one.
"""

from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from edge_harness.record import Record, read_records
from edge_harness.report.printers import md_table
from edge_infer.api import UsageError, latest


def machine_id(r: Record) -> str:
    """ISA level and a short hash of the whole fingerprint: readable, and distinct per CPU."""
    text = "|".join([r.cpu_model, r.cpu_id, r.isa, ",".join(sorted(r.cpu_flags))])
    return f"{r.isa or 'unknown'}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def machine_key(r: Record) -> tuple:
    """A measurement on one machine: a newer run on another CPU never replaces it."""
    return (machine_id(r), *r.key)


def collect(paths: list[Path]) -> list[Record]:
    """The bench records of every JSONL file named, or found (*.jsonl) in a folder named."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise UsageError(f"{p}: no *.jsonl records in this folder")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"{p}: no such file or folder")
    out: list[Record] = []
    for f in files:
        try:
            out += read_records(f)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if not out:
        raise UsageError(f"no bench records in {', '.join(map(str, files))}")
    return out


@dataclass
class Row:
    machine: str
    record: Record
    ratio: float | None

    @property
    def build(self) -> str:
        return f"{self.record.engine}:{self.record.quant}"


def rows(records: list[Record], baseline: str | None) -> list[Row]:
    """The newest record per machine and measurement, each with its ratio to the baseline
    build of the same machine (None where that machine has no such baseline)."""
    newest = latest(records, machine_key)
    base = {}
    for r in newest:
        if baseline and f"{r.engine}:{r.quant}" == baseline:
            base[(machine_id(r), r.model, r.test, r.threads)] = r.median
    out = []
    for r in newest:
        m = machine_id(r)
        b = base.get((m, r.model, r.test, r.threads))
        out.append(Row(m, r, r.median / b if b else None))
    out.sort(key=lambda x: (x.machine, x.record.model, x.record.test, x.record.threads, x.build))
    return out


def machines(records: list[Record]) -> list[list[str]]:
    """One line per machine: its id, CPU, ISA, the fleet kinds and nodes it answered as."""
    seen: dict[str, dict] = {}
    for r in records:
        m = seen.setdefault(machine_id(r), {"cpu": r.cpu_model, "isa": r.isa, "kinds": set(),
                                            "hosts": set(), "n": 0})
        fleet = r.extra.get("fleet") or {}
        if fleet.get("kind"):
            m["kinds"].add(fleet["kind"])
        if fleet.get("hostname"):
            m["hosts"].add(fleet["hostname"])
        m["n"] += 1
    return [[mid, m["cpu"], m["isa"], ", ".join(sorted(m["kinds"])) or "-",
             ", ".join(sorted(m["hosts"])) or "-", str(m["n"])]
            for mid, m in sorted(seen.items())]


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(records: list[Record], baseline: str | None) -> str:
    head = md_table(["machine", "CPU", "ISA", "fleet kinds", "nodes", "records"], machines(records))
    ratio = f"/ {baseline} (same machine)" if baseline else "ratio"
    body = md_table(["machine", "model", "test", "threads", "build", "median", "sd", "unit", ratio],
                    [[x.machine, x.record.model, x.record.test, str(x.record.threads), x.build,
                      _fmt(x.record.median), _fmt(x.record.sd), x.record.unit, _fmt(x.ratio)]
                     for x in rows(records, baseline)])
    return head + "\n" + body


def to_csv(records: list[Record], baseline: str | None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["machine", "cpu_model", "isa", "model", "test", "threads", "engine", "quant",
                "median", "sd", "unit", "ratio_to_baseline", "baseline"])
    for x in rows(records, baseline):
        r = x.record
        w.writerow([x.machine, r.cpu_model, r.isa, r.model, r.test, r.threads, r.engine, r.quant,
                    r.median, r.sd, r.unit, "" if x.ratio is None else round(x.ratio, 4),
                    baseline or ""])
    return buf.getvalue()
