"""The serving page: `serve.md` and `serve.png` from `serve.jsonl` (bench/serve.py's records):
per model and workload, the newest run only, so that a table and its ratios come from one run.
`edge-infer bench report` writes them when serve.jsonl sits beside bench.jsonl;
`tools/check_docs.py` checks the page is not stale.
"""

from __future__ import annotations

from pathlib import Path

from edge_harness.bench.merge import machine_id
from edge_harness.record import Record, read_records
from edge_harness.report.printers import md_table
from edge_harness.report.render import latest_per_machine, machine_label, provenance

KIND = "serve"  # bench.serve.KIND (not imported: that module imports the servers' machinery)
COLUMNS = ["concurrency", "engine", "quant", "output tok/s", "req/s", "TTFT p50 ms",
           "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "failed", "guard"]


def _ms(r: Record, metric: str, stat: str) -> str:
    v = r.extra.get(f"{metric}_ms", {}).get(stat)
    return "" if v is None else f"{v:.0f}"


def _row(r: Record) -> list[str]:
    x = r.extra
    return [str(x["concurrency"]), r.engine, r.quant, f"{r.median:.2f}", f"{x['requests_s']:.3f}",
            _ms(r, "ttft", "p50"), _ms(r, "ttft", "p99"), _ms(r, "tpot", "p50"),
            _ms(r, "tpot", "p99"), str(x["failed"]), r.guard]


def prefix_of(r: Record) -> int:
    """The workload's shared-prefix tokens (0: random prompts, caching off)."""
    return r.extra.get("workload", {}).get("shared_prefix", 0)


def table_key(r: Record) -> tuple:
    """What one table shows: a model, a workload, a machine (a newer run on another CPU
    adds its own table; it never replaces this one's)."""
    return (r.model, prefix_of(r), machine_id(r))


def tables(records: list[Record]) -> list[tuple[tuple, list[Record]]]:
    """Each table's key (table_key) and records, in page order: the one grouping the page,
    its plot and comparison.md's serving rows share."""
    return [(key, [r for r in records if table_key(r) == key])
            for key in sorted({table_key(r) for r in records})]


def order(r: Record) -> tuple:
    return (r.model, prefix_of(r), r.extra["concurrency"], r.engine != "ours", r.quant)


def newest_runs(records: list[Record]) -> list[Record]:
    """Per (model, workload, machine), the records of its newest run, newest of each (build,
    concurrency) within it. Both servers are measured in one run on one machine state; an
    older run of another build never fills in a row or a ratio beside them."""
    newest: dict[tuple, str] = {}
    for r in records:
        key = table_key(r)
        newest[key] = max(newest.get(key, r.run_id), r.run_id)
    return latest_per_machine([r for r in records if r.run_id == newest[table_key(r)]])


def table(records: list[Record]) -> str:
    """One row per (build, concurrency), then ours / llama.cpp at each concurrency."""
    rows = sorted(records, key=order)
    out = md_table(COLUMNS, [_row(r) for r in rows])
    ratios = ratio_rows(rows)
    if ratios:
        out += "\n" + md_table(["model", "concurrency", "pair", "output tok/s ratio",
                                "TTFT p99 ratio"], ratios)
    return out


def ratio_rows(records: list[Record]) -> list[list[str]]:
    """ours / llama.cpp per model, workload and concurrency: output throughput (> 1: ours
    serves more) and p99 TTFT (< 1: ours answers sooner)."""
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        key = (r.model, r.test)
        groups.setdefault(key, {}).setdefault(r.engine, r)
    rows = []
    for (model, _), by in groups.items():
        ours, theirs = by.get("ours"), by.get("llama.cpp")
        if ours is None or theirs is None or not theirs.median:
            continue
        t_ours, t_theirs = (x.extra.get("ttft_ms", {}).get("p99") for x in (ours, theirs))
        ttft = f"{t_ours / t_theirs:.2f}" if t_ours and t_theirs else ""
        # a server that failed requests served less than it was asked: the ratio says so
        failed = {x.engine: x.extra.get("failed", 0) for x in (ours, theirs) if x.extra.get("failed")}
        note = f" ({', '.join(f'{e} failed {n}' for e, n in failed.items())})" if failed else ""
        rows.append([model, str(ours.extra["concurrency"]), f"{ours.quant} / {theirs.quant}",
                     f"{ours.median / theirs.median:.2f}{note}", ttft])
    return rows


def render(results: Path, out: Path) -> Path:
    """Write serve.md (and serve.png) into `out`; returns the page."""
    shown = newest_runs(read_records(results, kind=KIND))
    out.mkdir(parents=True, exist_ok=True)
    parts = [header(shown)]
    for (model, prefix, _), sub in tables(shown):
        w = sub[0].extra["workload"]
        what = (f"prompts {w['input_len'][0]}-{w['input_len'][1]} tokens, outputs "
                f"{w['output_len'][0]}-{w['output_len'][1]}"
                + (f", a shared prefix of {prefix} tokens (prefix caching on)" if prefix
                   else ", random prompts (prefix caching off)"))
        parts.append(f"\n## {model}, {sub[0].isa}: {what}\n\n{run_line(sub)}\n\n"
                     + table(sub))
    if shown:
        png = plot(shown, out / "serve.png")
        parts.append(f"\n## Plot\n\n![serve]({png.name})\n")
    page = out / "serve.md"
    page.write_text("".join(parts))
    return page


def run_line(records: list[Record]) -> str:
    """The one run a table shows: its id, git state, machine and threads (tables of one page
    may come from different machines; a tok/s says nothing without its CPU)."""
    r = records[0]
    git = (r.git_commit or "?")[:10] + (" (dirty)" if r.git_dirty else "")
    return (f"Run `{r.run_id}`, git {git}, on {machine_label(r)}, "
            f"{r.threads} threads on cores {r.cores}.")


def header(shown: list[Record]) -> str:
    servers = sorted({r.engine_version for r in shown})
    clients = sorted({r.extra["client"]["tool"] for r in shown})
    lines = [
        "# Serving under load: edge-infer serve against llama-server",
        "",
        "Rendered by `edge-infer bench report` from `serve.jsonl`: per model and workload, "
        "its newest run, both servers measured in it. Each server is started with one slot per concurrent "
        "request, the same context per slot, pinned to the same cores with the same thread "
        "count, one server at a time; the load is vLLM's serving benchmark client "
        f"({', '.join(clients)}) with the same seeded random requests for both: one warm-up "
        "request per slot, then the measured window. TTFT: time to first token; TPOT: time "
        "per output token after the first, per request.",
        "",
        *provenance(shown, (f"- servers: {'; '.join(servers)}",)),
    ]
    return "\n".join(lines) + "\n"


def plot(records: list[Record], path: Path) -> Path:
    """Output throughput and p99 TTFT against concurrency, one line per build, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = tables(records)
    fig, axes = plt.subplots(2, len(panels), figsize=(max(6, 4.5 * len(panels)), 7),
                             squeeze=False)
    for col, ((model, prefix, _), rs) in enumerate(panels):
        for build in sorted({(r.engine, r.quant) for r in rs}):
            line = sorted((r for r in rs if (r.engine, r.quant) == build),
                          key=lambda r: r.extra["concurrency"])
            cs = [r.extra["concurrency"] for r in line]
            color = "tab:blue" if build[0] == "ours" else "tab:orange"
            label = f"{build[0]} {build[1]}"
            axes[0][col].plot(cs, [r.median for r in line], "o-", color=color, label=label)
            axes[1][col].plot(cs, [r.extra["ttft_ms"].get("p99", float("nan")) / 1000
                                   for r in line], "o-", color=color, label=label)
        title = f"{model}, {rs[0].isa}" + (f" (shared prefix {prefix})" if prefix else "")
        axes[0][col].set_title(title, fontsize=9)
        axes[0][col].set_ylabel("output tok/s")
        axes[1][col].set_ylabel("TTFT p99, s")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("concurrent requests")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
