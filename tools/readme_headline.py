#!/usr/bin/env python3
"""The README's headline, generated from docs/results/bench.jsonl (never typed by hand).

Per model, the newest run that measured our default 4-bit build (w4a16-head, no options)
against llama.cpp Q4_K_M, with W4A8-head beside it when the run has it: one table from that
run alone, with its medians, min-max, ceiling,
machine, versions, guard verdict, command and commit. `python3 tools/readme_headline.py`
rewrites the block between the markers; `--check` (run by tools/check_docs.py) fails when the
committed block differs from what the records give.
"""

from __future__ import annotations

import sys

from generated_block import ROOT, bench_records, cell, rewrite

from edge_harness.report.render import REFERENCE, noise_verdict

START, END = "<!-- headline:start (tools/readme_headline.py) -->", "<!-- headline:end -->"
MODELS = ("qwen3-0.6b-random", "spark-x2.5-1.7b-random")
OURS = ("ours", "w4a16-head")
# Our other 4-bit schemes with the head in 4 bits too, shown beside it when the same run has
# them: which scheme wins depends on the CPU (W4A8's int8 dot products against bf16 ones).
ALSO = (("ours", "w4a8-head"),)
# llama.cpp Q4_K_M as llama-bench itself times it, else (older runs) as our llama.cpp runner does
TESTS = ("tg128", "pp512")
THEIRS_BY_PREFERENCE = [(engine, "q4_k_m") for engine in REFERENCE]


def _key(r: dict) -> tuple:
    return r["engine"], r["quant"]


def newest_pair_run(records: list[dict], model: str) -> list[dict]:
    runs: dict[str, list[dict]] = {}
    for r in records:
        if r.get("model") == model and not r.get("extra", {}).get("options"):
            runs.setdefault(r["run_id"], []).append(r)
    paired = [rs for rs in runs.values()
              if (ref := theirs(rs)) and complete(rs, ref) and not any(r.get("git_dirty") for r in rs)]
    return max(paired, key=lambda rs: max(r["timestamp"] for r in rs), default=[])


def complete(run: list[dict], ref: tuple[str, str]) -> bool:
    """Both engines have both tests: a run the guard stopped halfway does not make a table."""
    have = {(_key(r), r["test"]) for r in run}
    return all((k, t) in have for k in (OURS, ref) for t in TESTS)


def theirs(run: list[dict]) -> tuple[str, str] | None:
    keys = {_key(r) for r in run}
    return next((k for k in THEIRS_BY_PREFERENCE if k in keys), None)


def ceiling_of(records: list[dict], run: list[dict]) -> str:
    """Whose streaming ceiling the run's % figures use: its own, or (a run with
    `--no-ceiling`) the newest earlier ceiling of the same cores, which `bench run` reuses."""
    ceilings = [r for r in records if r["test"] == "ceiling" and r["cores"] == run[0]["cores"]]
    if any(c["run_id"] == run[0]["run_id"] for c in ceilings):
        return "the run's"
    start = min(r["timestamp"] for r in run)
    earlier = [c for c in ceilings if c["timestamp"] <= start]
    return f"run `{earlier[-1]['run_id']}`'s (reused: `--no-ceiling`)" if earlier else "a"


def table(run: list[dict], model: str, records: list[dict]) -> str:
    by = {(_key(r), r["test"]): r for r in run}
    ref = theirs(run)
    timed_by = "llama-bench" if ref[0] == "llama-bench" else "our llama.cpp runner"
    lines = [f"**{model}**, run `{run[0]['run_id']}`:", "",
             f"| test | ours | ours, tok/s | llama.cpp Q4_K_M ({timed_by}), tok/s | ratio |",
             "|---|---|---:|---:|---:|"]
    for test in TESTS:
        for ours in (OURS, *ALSO):
            a, b = by.get((ours, test)), by.get((ref, test))
            if a and b:
                lines.append(f"| {test} | {ours[1]} | {cell(a)} | {cell(b)} | "
                             f"**{a['median'] / b['median']:.2f}x** "
                             f"{noise_verdict(a['samples'], b['samples'])} |")
    tg = by.get((OURS, "tg128")), by.get((ref, "tg128"))
    r = run[0]
    facts = [
        f"- machine: {r['cpu_model']} ({r['isa']}; {', '.join(r['cpu_flags'])}), "
        f"{r['threads']} threads on cores {r['cores']}",
        f"- versions: {tg[0]['engine_version'] if tg[0] else ''}; {tg[1]['engine_version'] if tg[1] else ''}",
        f"- guard: {', '.join(sorted({x['guard'] for x in run}))}; medians of "
        f"{len(r['samples'])} interleaved repetitions (min-max in brackets); a ratio is faster "
        "or slower only when the two ranges do not overlap, else within noise",
    ]
    if all(tg):
        facts.append(f"- decode streams {tg[0]['achieved_gbs']:.1f} / {tg[1]['achieved_gbs']:.1f} GB/s "
                     f"of {ceiling_of(records, run)} {tg[0]['ceiling_gbs']:.1f} GB/s streaming "
                     "ceiling")
    facts.append(f"- command: `{r['command']}` at commit {r['git_commit'][:7]} (clean tree)")
    return "\n".join(lines + [""] + facts)


def render(records: list[dict]) -> str:
    parts = [table(run, m, records) for m in MODELS if (run := newest_pair_run(records, m))]
    return "\n\n".join(parts) or "(no paired run recorded yet)"


def main() -> int:
    return rewrite(ROOT / "README.md", START, END, render(bench_records()), "--check" in sys.argv,
                   "README.md: the headline is stale; run python3 tools/readme_headline.py")


if __name__ == "__main__":
    sys.exit(main())
