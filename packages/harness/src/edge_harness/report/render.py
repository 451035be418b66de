"""`edge-infer bench report`: markdown tables and PNG plots from the results JSONL.

The newest record of each (model, engine, quant, test, threads) is shown; older ones stay in
the JSONL as history. Output in `--out` (default docs/results/): report.md, prefill.png,
decode.png, roofline.png and, when GEMM records exist, gemm.png. Records of llama-bench
beside our llama.cpp runner (kind llama_bench_crosscheck) get their own table. The ratio table (ours /
llama.cpp) is also printed, since it is the number people ask for.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

from edge_harness.bench.crosscheck import KIND, TOLERANCE
from edge_harness.bench.crosscheck import table as crosscheck_table
from edge_harness.bench.merge import machine_id, machine_key
from edge_harness.record import Record, read_records
from edge_harness.report.printers import GEMM_COLUMNS, MD_COLUMNS, gemm_row, is_gemm, md_row, md_table
from edge_infer.api import latest as newest_per_key

# Which builds are compared: ours at a quant against llama.cpp at the nearest format.
PAIRS = (("w4a16", "q4_k_m"), ("w4a16-head", "q4_k_m"), ("w4a8", "q4_k_m"), ("w4a8-head", "q4_k_m"),
         ("w4a16", "q4_0"), ("w4a16-head", "q4_0"), ("bf16", "bf16"), ("bf16", "f16"))
# The llama.cpp side of a ratio, in order of preference: llama-bench itself (runners/llama_bench)
# where the run timed it, else our llama.cpp runner (runs before llama-bench joined `bench run`).
REFERENCE = ("llama-bench", "llama.cpp")


def latest(records: list[Record]) -> list[Record]:
    return newest_per_key(records, key=lambda r: r.key)


def latest_per_machine(records: list[Record]) -> list[Record]:
    """The newest record of each measurement on each machine: a newer run on one CPU never
    hides another CPU's figure for the same test."""
    return newest_per_key(records, key=machine_key)


def machine_label(r: Record) -> str:
    """A row's CPU as the tables name it (a tok/s says nothing without it)."""
    return f"{r.cpu_model} ({r.isa}" + (f", {r.cpu_id})" if r.cpu_id else ")")


def fill_ceiling(records: list[Record]) -> None:
    """Decode results of a run without a ceiling (`bench run --no-ceiling`) get the one that
    run would have reused: the newest ceiling of the same cores measured before them. A GEMM
    record keeps what its own run gave it: a % only of that run's ceiling, and only at
    decode-sized M (a prefill-sized call is not bandwidth-bound)."""
    ceilings = sorted(((machine_id(r), r) for r in records if r.test == "ceiling"),
                      key=lambda mc: mc[1].timestamp)
    for r in records:
        if r.achieved_gbs is None or r.pct_ceiling is not None or is_gemm(r):
            continue
        machine = machine_id(r)
        before = [c for m, c in ceilings
                  if m == machine and c.cores == r.cores and c.timestamp <= r.timestamp]
        if before:
            r.against_ceiling(max(before[-1].samples))
            r.extra["ceiling_from_report"] = True


def noise_verdict(ours: list[float], theirs: list[float]) -> str:
    """'faster' or 'slower' only when the min-max ranges of the repetitions do not overlap;
    otherwise 'within noise', whatever the ratio of the medians says."""
    if min(ours) > max(theirs):
        return "faster"
    if max(ours) < min(theirs):
        return "slower"
    return "within noise"


def is_speed(r: Record) -> bool:
    return r.test.startswith(("pp", "tg"))


def ratio_rows(records: list[Record], pool: list[Record] | None = None) -> list[list[str]]:
    """Ours / llama.cpp per machine, model, pair and test. A ratio is formed only within one
    run (same run_id: interleaved, same machine state): the newest ours record of that machine
    against the llama.cpp record of that same run, looked up in `pool` (all records; default
    `records`). Each row names its machine."""
    # keyed by build (quant and options): a variant (`@act_dtype=...`) never stands in for
    # the build PAIRS names
    newest = {(machine_id(r), r.model, r.engine, r.build, r.test, r.threads): r
              for r in records if is_speed(r)}
    by_run = {(r.run_id, r.model, r.engine, r.build, r.test, r.threads): r
              for r in (pool or records) if is_speed(r)}

    def pair(machine, model, ours_q, llama_q, test, t):
        a = newest.get((machine, model, "ours", ours_q, test, t))
        b = next((by_run[k] for e in REFERENCE
                  if (k := (a.run_id, model, e, llama_q, test, t)) in by_run), None) if a else None
        return (a, b) if b else (None, None)

    rows = []
    labels = {machine_id(r): machine_label(r) for r in records if is_speed(r)}
    models = sorted({r.model for r in records if is_speed(r)})
    threads = sorted({r.threads for r in records if is_speed(r)})
    tests = sorted({r.test for r in records if is_speed(r)}, key=lambda t: (t[:2] != "pp", t))
    for model, machine, t, (ours_q, llama_q) in itertools.product(models, sorted(labels), threads,
                                                                   PAIRS):
        cells = []
        runs = set()  # each test's pair is of one run, but pp and tg may come from different runs
        pairs = {test: pair(machine, model, ours_q, llama_q, test, t) for test in tests}
        for test in tests:
            a, b = pairs[test]
            if a and b:
                runs.add(a.run_id)
                cells += [f"{a.median:.2f}", f"{b.median:.2f}",
                          f"**{a.median / b.median:.2f}x** "
                          f"{noise_verdict(a.samples, b.samples)}"]
            else:
                cells += ["", "", ""]
        if not runs:
            continue
        tg = [x for x in tests if x.startswith("tg")]
        a, b = pairs[tg[0]] if tg else (None, None)
        theirs = b.engine if b else "llama.cpp"
        rows.append([model, labels[machine], str(t), f"ours {ours_q} / {theirs} {llama_q}",
                     *cells, _pct(a), _pct(b), ", ".join(f"`{r}`" for r in sorted(runs))])
    return rows


def ratio_header(records: list[Record]) -> list[str]:
    tests = sorted({r.test for r in records if is_speed(r)}, key=lambda t: (t[:2] != "pp", t))
    head = ["model", "machine", "threads", "pair"]
    for test in tests:
        head += [f"ours {test}", f"llama.cpp {test}", f"ratio {test}"]
    return head + ["ours % ceil", "llama.cpp % ceil", "run"]


def _pct(r: Record | None) -> str:
    return "" if r is None or r.pct_ceiling is None else f"{r.pct_ceiling:.1f}"


def ratio_table(records: list[Record], pool: list[Record] | None = None) -> str:
    rows = ratio_rows(records, pool)
    if not rows:
        return "(no pair of ours / llama.cpp results to compare)\n"
    return md_table(ratio_header(records), rows)


def provenance(shown: list[Record], extra: tuple[str, ...] = ()) -> list[str]:
    """A rendered page's provenance bullets for the records it shows: machines, when, git
    state, any `extra` bullets, the commands; then a warning if any was measured past the
    guard (`--force`)."""
    cpus = sorted({f"{r.cpu_model} ({r.isa})" for r in shown})
    commits = sorted({(r.git_commit or "?")[:10] + ("+dirty" if r.git_dirty else "")
                      for r in shown})
    commands = list(dict.fromkeys(r.command for r in shown if r.command))
    times = sorted(r.timestamp for r in shown)
    overridden = [r for r in shown if r.guard != "ok"]
    lines = [
        f"- machine: {'; '.join(cpus)}",
        f"- measured: {times[0] if times else '?'} .. {times[-1] if times else '?'}",
        f"- git: {', '.join(commits)}",
        *extra,
        "- commands:",
        *[f"  - `{c}`" for c in commands],
    ]
    if overridden:
        lines += ["", f"**Warning: {len(overridden)} of these results were measured with the "
                  "contention guard overridden (`--force`) on a busy machine: treat them as "
                  "smoke tests, not as speed figures.**"]
    return lines


def header(all_records: list[Record], shown: list[Record]) -> str:
    lines = [
        "# edge-infer benchmark results",
        "",
        "Rendered by `edge-infer bench report` from `bench.jsonl` (newest record of each "
        "measurement). llama-bench semantics: pp = one prefill of N random tokens, tg = N "
        "single-token decodes from an empty cache; t/s = mean ± sd over the repetitions, "
        "after one warm-up; engines interleaved; every engine pinned to the same physical "
        "cores with the same thread count.",
        "",
        *provenance(shown),
    ]
    return "\n".join(lines) + "\n"


def render(results: Path, out: Path) -> str:
    """Write report.md and plots into `out`; returns the ratio table (markdown)."""
    all_records = read_records(results)
    shown = latest(all_records)
    fill_ceiling(shown)
    # per machine: a newer run on one CPU must not hide another CPU's rows of the same test
    # (the ratio table and batched decode; the per-model tables, GEMM and plots show the
    # newest record of each measurement, whichever machine ran it)
    per_machine = [r for r in latest_per_machine(all_records) if is_speed(r)]
    fill_ceiling(per_machine)
    batched = newest_per_key((r for r in all_records if r.test.startswith("batched_")),
                             key=machine_key)
    out.mkdir(parents=True, exist_ok=True)
    parts = [header(all_records, shown + [r for r in per_machine + batched if r not in shown])]
    ceilings = [r for r in shown if r.test == "ceiling"]
    if ceilings:
        parts.append("\n## Streaming-read ceiling\n\n" + md_table(
            ["threads", "cores", "best GB/s", "median GB/s", "method"],
            [[str(r.threads), ",".join(map(str, r.cores)), f"{max(r.samples):.2f}",
              f"{r.median:.2f}", str(r.extra.get("method", ""))] for r in ceilings]))
    speed = [r for r in shown if is_speed(r)]
    for model in sorted({r.model for r in speed}):
        rows = sorted((r for r in speed if r.model == model),
                      key=lambda r: (r.threads, r.test[:2] != "pp", r.test, r.engine, r.quant))
        parts.append(f"\n## {model}\n\n" + md_table(MD_COLUMNS, [md_row(r) for r in rows]))
    ratios = ratio_table(per_machine, all_records)
    parts.append("\n## Ours / llama.cpp (medians, tok/s; each ratio within one run)\n\n"
                 "The newest pair of each machine.\n\n" + ratios)
    gemm = [r for r in shown if is_gemm(r)]
    if gemm:
        rows = [gemm_row(r) for r in sorted(gemm, key=lambda r: (
            r.model, r.extra["m"], r.extra["layer"], r.engine, r.quant, r.test))]
        parts.append("\n## GEMM microbenchmark\n\nTiming `op`: through the torch op, as Python "
                     "calls it; `loop`: the same calls back to back from C++, as our fused "
                     "decoder-layer ops make them. % ceiling: of the same run's streaming "
                     "ceiling, decode-sized M only.\n\n" + md_table(GEMM_COLUMNS, rows))
    if batched:
        parts.append("\n## Batched decode\n\n`edge-infer bench batched`: B sequences decoded "
                     "together after a 1-token prompt each; ours through vLLM, llama.cpp through "
                     "its own `llama-batched-bench` on the same GGUF. Time per step, median "
                     "(min-max) of the repetitions; x B=1 is within one engine and one run; "
                     "tok/s = B / step.\n\n" + batched_table(batched))
    regions = [r for r in shown if r.test == "parallel_region"]
    if regions:
        parts.append("\n## Cost of one parallel region\n\nAn empty `at::parallel_for` (OpenMP), "
                     "entered and left; every 4-bit kernel call pays it at least once.\n\n"
                     + md_table(["threads", "cores", "median us", "min us", "guard"],
                                [[str(r.threads), ",".join(map(str, r.cores)), f"{r.median:.2f}",
                                  f"{min(r.samples):.2f}", r.guard]
                                 for r in sorted(regions, key=lambda r: r.threads)]))
    peaks = [r for r in shown if r.test == "dot_peak"]
    if peaks:
        parts.append("\n## Arithmetic peak of one dot instruction\n\nEvery thread issues one "
                     "instruction back to back on registers (12 independent chains, no memory "
                     "traffic): the compute ceiling that a batched-decode or prefill kernel is "
                     "held against, as the streaming ceiling is for M=1.\n\n"
                     + md_table(["instruction", "threads", "cores", "median GMAC/s",
                                 "min-max", "guard"],
                                [[str(r.extra.get("instruction", r.quant)), str(r.threads),
                                  ",".join(map(str, r.cores)), f"{r.median:.1f}",
                                  f"{min(r.samples):.1f}-{max(r.samples):.1f}", r.guard]
                                 for r in sorted(peaks, key=lambda r: (r.quant, r.threads))]))
    checks = latest(read_records(results, kind=KIND))
    if checks:
        builds = sorted({r.engine_version for r in checks})
        where = sorted({f"{r.cpu_model} ({r.isa}), commit {(r.git_commit or '?')[:10]}"
                        + ("+dirty" if r.git_dirty else "") for r in checks})
        commands = list(dict.fromkeys(r.command for r in checks if r.command))
        parts.append(
            "\n## llama-bench beside our llama.cpp runner\n\n"
            "The real llama-bench (built from the llama-cpp-python sdist our runner links) and "
            "our runner (runners/llamacpp.py) on the same GGUF, cores and threads, under the same "
            "guard, alternating: each round one `llama-bench -r 1` (its own warm-up), then one "
            "repetition of ours. Medians (min-max) of the rounds; agree: the medians are within "
            f"±{TOLERANCE:.0%}. Builds: {'; '.join(builds)}. Measured on: "
            f"{'; '.join(where)}. Commands: "
            + "; ".join(f"`{c}`" for c in commands) + ".\n\n" + crosscheck_table(checks))
    plots = plot(shown, out)
    if plots:
        parts.append("\n## Plots\n\n" + "".join(f"![{p.stem}]({p.name})\n\n" for p in plots))
    (out / "report.md").write_text("".join(parts))
    return ratios


def batched_table(records: list[Record]) -> str:
    """One row per record, each machine's rows together (its CPU and ISA named: a step time
    says nothing without them); x B=1 within one engine and one run."""
    one = {(r.run_id, r.model, r.engine, r.quant, r.n_gen): r for r in records
           if r.extra.get("batch") == 1}
    rows = []
    for r in sorted(records, key=lambda r: (machine_id(r), r.model, r.engine, r.quant,
                                            r.n_gen or 0, r.extra.get("batch", 0), r.timestamp)):
        b = r.extra.get("batch", 0)
        base = one.get((r.run_id, r.model, r.engine, r.quant, r.n_gen))
        rows.append([machine_label(r), r.model, r.engine, r.quant, str(b),
                     str(r.n_gen), f"{r.median:.2f} ({min(r.samples):.2f}-{max(r.samples):.2f})",
                     f"{r.median / base.median:.2f}x" if base else "",
                     f"{b / r.median * 1e3:.1f}", r.guard, r.run_id])
    return md_table(["machine", "model", "engine", "quant", "B", "steps", "ms per step", "x B=1",
                     "tok/s", "guard", "run"], rows)


def plot(records: list[Record], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    speed = [r for r in records if is_speed(r)]
    for prefix, name, title in (("pp", "prefill", "Prefill"), ("tg", "decode", "Decode")):
        rs = [r for r in speed if r.test.startswith(prefix)]
        if rs:
            made.append(_bars(plt, rs, lambda r: r.mean, lambda r: r.sd, "tok/s",
                              f"{title} ({', '.join(sorted({r.test for r in rs}))}), mean ± sd",
                              out / f"{name}.png"))
    rs = [r for r in speed if r.pct_ceiling is not None]
    if rs:
        made.append(_bars(plt, rs, lambda r: r.pct_ceiling, lambda r: 0.0,
                          "% of streaming-read ceiling",
                          "Decode: weight bytes read per token x tok/s, vs the ceiling",
                          out / "roofline.png"))
    gemm = [r for r in records if r.test.startswith("gemm_m1_")]
    if gemm:
        made.append(_gemm(plt, gemm, out / "gemm.png"))
    return made


def _bars(plt, rs: list[Record], value, err, ylabel: str, title: str, path: Path) -> Path:
    models = sorted({r.model for r in rs})
    builds = sorted({(r.engine, r.build, r.threads) for r in rs})
    by = {(r.model, r.engine, r.build, r.threads): r for r in rs}
    fig, axes = plt.subplots(1, len(models), figsize=(max(6, 4 * len(models)), 4.5),
                             squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        labels, vals, errs = [], [], []
        for e, q, t in builds:
            r = by.get((model, e, q, t))
            if r is None:
                continue
            labels.append(f"{e}\n{q}" + (f"\n{t}t" if len({b[2] for b in builds}) > 1 else ""))
            vals.append(value(r))
            errs.append(err(r))
        colors = ["tab:blue" if lbl.startswith("ours") else "tab:orange"
                  if lbl.startswith("llama") else "tab:gray" for lbl in labels]
        ax.bar(range(len(vals)), vals, yerr=errs, color=colors, capsize=3)
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set_title(model, fontsize=9)
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _gemm(plt, rs: list[Record], path: Path) -> Path:
    groups = defaultdict(dict)
    for r in rs:
        groups[(r.model, r.extra["layer"])][f"{r.engine} {r.quant}"] = r.achieved_gbs
    impls = sorted({k for g in groups.values() for k in g})
    keys = sorted(groups)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4.5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [groups[k].get(impl, 0.0) for k in keys], width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))],
                  [f"{m}\n{layer}" for m, layer in keys], fontsize=7)
    ax.set_ylabel("weight GB/s at M=1")
    ax.set_title("GEMV (decode shape): weight bytes streamed per second", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
