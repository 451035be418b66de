"""Printers over the one record type: md, csv, json, jsonl, sql (llama-bench's -o formats).

Each printer is a function `records -> str`; adding a format is adding one function to
PRINTERS. Every format opens with the fields llama-bench prints under the same names and
meanings (`llama_bench_fields`), so a script written for llama-bench's output reads ours;
our own record's fields follow. md shows the columns people quote; the others carry every
field.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Callable

from edge_harness.record import Record

# llama-bench's field names, in its order, for what both tools record (tools/llama-bench,
# `test::get_fields()`; JSON adds samples_ns and samples_ts). Left out: what we have no
# honest value for (build_number, gpu_info, model_filename, model_size, model_n_params,
# n_batch, n_ubatch, type_k/v, n_gpu_layers, flash_attn, ...).
LLAMA_BENCH_FIELDS = ("build_commit", "cpu_info", "backends", "model_type", "n_threads",
                      "cpu_mask", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns",
                      "stddev_ns", "avg_ts", "stddev_ts")
LLAMA_BENCH_SAMPLES = ("samples_ns", "samples_ts")

# llama-bench's markdown columns first (model, threads, test, t/s), then ours.
MD_COLUMNS = ("model", "threads", "test", "t/s", "engine", "quant", "bits/w", "median",
              "GB/s", "% ceil", "guard")


def _num(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def md_row(r: Record) -> list[str]:
    if r.unit == "tok/s":
        speed = f"{r.mean:.2f} ± {r.sd:.2f}"
    else:
        speed = f"{r.mean:.2f} ± {r.sd:.2f} {r.unit}"
    return [r.model, str(r.threads), r.test, speed, r.engine, r.build, _num(r.bits_per_weight),
            _num(r.median), _num(r.achieved_gbs), _num(r.pct_ceiling, 1), r.guard]


def md_table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    right = {i for i, h in enumerate(header) if h not in ("model", "engine", "quant", "test",
                                                          "guard", "layer", "impl", "pair", "method",
                                                          "cores", "machine")}
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def gemm_gbs(r: Record) -> str:
    """Weight GB/s of a GEMM record, shown for decode shapes only: at prefill M the weights
    are reused from cache M times and the figure means nothing."""
    return f"{r.achieved_gbs:.2f}" if r.extra.get("m", 1) < 16 else ""


GEMM_COLUMNS = ["model", "M", "layer", "N x K", "impl", "quant", "timing", "GFLOP/s", "GB/s",
                "% ceiling", "guard"]


def is_gemm(r: Record) -> bool:
    """A bench gemm record: `gemm_` timed through the op as Python calls it, `gemmloop_` the
    same calls made back to back from C++."""
    return r.test.startswith(("gemm_", "gemmloop_"))


def gemm_row(r: Record) -> list[str]:
    return [r.model, str(r.extra["m"]), r.extra["layer"], f"{r.extra['n']}x{r.extra['k']}",
            r.engine, r.quant, r.extra.get("timing", "op"), f"{r.median:.1f}", gemm_gbs(r),
            f"{r.pct_ceiling:.0f}" if r.pct_ceiling else "", r.guard]


def to_md(records: list[Record]) -> str:
    return md_table(MD_COLUMNS, [md_row(r) for r in records])


def llama_bench_fields(r: Record, samples: bool = True) -> dict:
    """The record under llama-bench's names and meanings: one test of n_prompt or n_gen
    tokens from an empty cache (n_depth 0), each repetition's time in ns and tokens/s, mean
    and sample sd of each. Timing fields are None for a record that is not tokens/s (a
    ceiling in GB/s, a GEMM in GFLOP/s): llama-bench has no name for those."""
    tokens = r.n_prompt + r.n_gen
    timed = r.unit == "tok/s" and tokens > 0 and bool(r.samples)
    ns = [round(1e9 * tokens / ts) for ts in r.samples] if timed else None
    sd_ns = (round(statistics.stdev(ns)) if len(ns) > 1 else 0) if timed else None
    d = {
        "build_commit": (r.git_commit or "unknown")[:8],
        "cpu_info": r.cpu_model,
        "backends": "CPU",
        "model_type": f"{r.model} {r.build}",
        "n_threads": r.threads,
        "cpu_mask": hex(sum(1 << c for c in r.cores)),
        "n_prompt": r.n_prompt,
        "n_gen": r.n_gen,
        "n_depth": 0,
        "test_time": r.timestamp,
        "avg_ns": round(statistics.fmean(ns)) if timed else None,
        "stddev_ns": sd_ns,
        "avg_ts": r.mean if timed else None,
        "stddev_ts": r.sd if timed else None,
    }
    if samples:
        d |= {"samples_ns": ns, "samples_ts": list(r.samples) if timed else None}
    return d


def row(r: Record, samples: bool = True) -> dict:
    """llama-bench's fields, then every field of our record not already among them."""
    shared = llama_bench_fields(r, samples)
    return shared | {k: v for k, v in r.to_dict().items() if k not in shared}


def _flat(r: Record) -> dict:
    # CSV and SQL carry no sample lists in llama-bench; ours are space-separated in one cell
    d = row(r, samples=False)
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
    return json.dumps([row(r) for r in records], indent=2) + "\n"


def to_jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(row(r)) + "\n" for r in records)


def to_sql(records: list[Record]) -> str:
    if not records:
        return ""
    rows = [_flat(r) for r in records]
    cols = list(rows[0])
    types = {c: _sql_type(next((r[c] for r in rows if r[c] is not None), None)) for c in cols}
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


def _sql_type(v) -> str:
    if isinstance(v, float):
        return "REAL"
    return "INTEGER" if isinstance(v, int) and not isinstance(v, bool) else "TEXT"


PRINTERS: dict[str, Callable[[list[Record]], str]] = {
    "md": to_md, "csv": to_csv, "json": to_json, "jsonl": to_jsonl, "sql": to_sql,
}
