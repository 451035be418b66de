"""Printers over the one record type: md, csv, json, jsonl, sql (llama-bench's -o formats).

Each printer is a function `records -> str`; adding a format is adding one function to
PRINTERS. md shows the columns people quote; the others carry every field.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable

from edge_harness.record import Record

MD_COLUMNS = ("model", "engine", "quant", "bits/w", "threads", "test", "t/s", "median",
              "GB/s", "% ceil", "guard")


def _num(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def md_row(r: Record) -> list[str]:
    if r.unit == "tok/s":
        speed = f"{r.mean:.2f} ± {r.sd:.2f}"
    else:
        speed = f"{r.mean:.2f} ± {r.sd:.2f} {r.unit}"
    return [r.model, r.engine, r.quant, _num(r.bits_per_weight), str(r.threads), r.test, speed,
            _num(r.median), _num(r.achieved_gbs), _num(r.pct_ceiling, 1), r.guard]


def md_table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    right = {i for i, h in enumerate(header) if h not in ("model", "engine", "quant", "test",
                                                          "guard", "layer", "impl", "pair", "method",
                                                          "cores")}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def gemm_gbs(r: Record) -> str:
    """Weight GB/s of a GEMM record, shown for decode shapes only: at prefill M the weights
    are reused from cache M times and the figure means nothing."""
    return f"{r.achieved_gbs:.2f}" if r.extra.get("m", 1) < 16 else ""


def to_md(records: list[Record]) -> str:
    return md_table(MD_COLUMNS, [md_row(r) for r in records])


def _flat(r: Record) -> dict:
    d = r.to_dict()
    for key in ("samples", "cores", "cpu_flags"):
        d[key] = " ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in d[key])
    d["extra"] = json.dumps(d["extra"], sort_keys=True)
    return d


def to_csv(records: list[Record]) -> str:
    if not records:
        return ""
    buf = io.StringIO()
    rows = [_flat(r) for r in records]
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(records: list[Record]) -> str:
    return json.dumps([r.to_dict() for r in records], indent=2, sort_keys=True) + "\n"


def to_jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in records)


def to_sql(records: list[Record]) -> str:
    if not records:
        return ""
    rows = [_flat(r) for r in records]
    cols = list(rows[0])
    types = {k: ("REAL" if isinstance(v, float) else "INTEGER"
                 if isinstance(v, int) and not isinstance(v, bool) else "TEXT")
             for k, v in rows[0].items()}
    out = ["CREATE TABLE IF NOT EXISTS bench (\n  "
           + ",\n  ".join(f"{c} {types[c]}" for c in cols) + "\n);"]
    for row in rows:
        vals = []
        for c in cols:
            v = row[c]
            if v is None:
                vals.append("NULL")
            elif isinstance(v, bool):
                vals.append("1" if v else "0")
            elif isinstance(v, (int, float)):
                vals.append(repr(v))
            else:
                vals.append("'" + str(v).replace("'", "''") + "'")
        out.append(f"INSERT INTO bench ({', '.join(cols)}) VALUES ({', '.join(vals)});")
    return "\n".join(out) + "\n"


PRINTERS: dict[str, Callable[[list[Record]], str]] = {
    "md": to_md, "csv": to_csv, "json": to_json, "jsonl": to_jsonl, "sql": to_sql,
}
