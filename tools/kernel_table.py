#!/usr/bin/env python3
"""docs/analysis/kernels.md's per-shape tables, one per `bench gemm` run (one per machine).

Per decode shape of the model: the GB/s of packed weights our AVX-512 kernels stream at M=1
(W4A16 and W4A8, bf16 activations; through the op, and from a C++ loop of calls where the run
has it, as a share of the same run's streaming ceiling), bf16 F.linear's at M=1 for scale, the
per-call time at M=8 of both and of F.linear, and the per-call time of both at M = 2..16 as a
multiple of its M=1 time (batched decode). Medians of the run's repetitions.
`python3 tools/kernel_table.py` rewrites the block between the markers;
`--check` fails when the committed block differs from what the records give.
"""

from __future__ import annotations

import statistics
import sys

from generated_block import ROOT, bench_records, rewrite

PAGE = ROOT / "docs" / "analysis" / "kernels.md"
START, END = "<!-- kernels:start (tools/kernel_table.py) -->", "<!-- kernels:end -->"
# (run at the threads of the machine's cores, the same shapes at M=1 on one thread or None,
# the model whose shapes the table shows: a run may sweep several)
RUNS = (("20261201T151411-3360", "20261201T101122-7520", "qwen3-0.6b-random"),
        ("20261202T154904-8960", None, "qwen3-0.6b-random"),
        ("20261202T154904-8960", None, "spark-x2.5-1.7b-random"),
        ("20261202T202136-0368", "20261202T203236-4480", "qwen3-0.6b-random"),
        ("20261202T202136-0368", "20261202T203236-4480", "spark-x2.5-1.7b-random"),
        # the Zen 5 EPYC (AuthenticAMD 26/2/1: full-width AVX-512, no AMX)
        ("20261207T231700-8336", "20261207T231959-6880", "qwen3-0.6b-random"),
        ("20261207T231700-8336", "20261207T231959-6880", "spark-x2.5-1.7b-random"))
LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
BATCH = (2, 4, 8, 16)


def block(records: list[dict]) -> str:
    return "\n".join(table(records, run, run_1t, model) for run, run_1t, model in RUNS)


def table(records: list[dict], run_id: str, run_1t: str | None, model: str) -> str:
    run = [r for r in records if r.get("run_id") == run_id and "layer" in r.get("extra", {})
           and r.get("model") == model]
    # `gemm_` records time the op as Python calls it; `gemmloop_` the same calls from a C++ loop
    by = {(r["engine"], r["quant"], r["extra"]["m"], r["extra"]["layer"]): r for r in run
          if r["test"].startswith("gemm_")}
    loop = {(r["quant"], r["extra"]["m"], r["extra"]["layer"]): r for r in run
            if r["test"].startswith("gemmloop_") and r["engine"] == "edge-avx512"}
    one_thread = {(r["test"].split("_")[0], r["quant"], r["extra"]["layer"]): r for r in records
                  if r.get("run_id") == run_1t and r.get("engine") == "edge-avx512"
                  and r.get("model") == model and r["extra"].get("m") == 1}
    ceiling = next((r for r in records if r.get("run_id") == run_id and r.get("test") == "ceiling"),
                   None)

    def seconds(key) -> float:
        return statistics.median(by[key]["extra"]["seconds"])

    r0 = run[0]
    machine = r0["cpu_model"] + (f" ({r0['cpu_id']})" if r0.get("cpu_id") else "")
    lines = ["", f"**{machine}**, {r0['isa']}, {model} shapes:", "",
             f"`{r0['command']}`, run `{run_id}` at commit {r0['git_commit'][:7]}"
             f"{' (dirty)' if r0['git_dirty'] else ' (clean tree)'}, {r0['threads']} threads on cores "
             f"{r0['cores']}, guard {', '.join(sorted({r['guard'] for r in run}))}; medians. "
             + (f"One thread: run `{run_1t}` (`{next(iter(one_thread.values()))['command']}`)."
                if one_thread else "One thread: not run.")
             + (f" Streaming ceiling of the same run: {max(ceiling['samples']):.2f} GB/s (best of "
                f"{len(ceiling['samples'])} passes; median {statistics.median(ceiling['samples']):.2f})."
                if ceiling else " No ceiling in this run.")
             + " GB/s at M=1 through the op (as Python calls it) / from a C++ loop of calls (as "
               "the fused decoder-layer ops make them; `-` where the run predates the loop timing).",
             "",
             "| layer | N x K | W4A16 GB/s, M=1: op / loop | W4A8 GB/s, M=1: op / loop | "
             "% of ceiling, loop: W4A16 / W4A8 | 1 thread: W4A16 / W4A8 GB/s, op / loop | "
             "bf16 F.linear GB/s, M=1 | ms per call at M=8: W4A16 / W4A8 / F.linear | "
             + " | ".join(f"time M={m} / M=1: W4A16 / W4A8" for m in BATCH) + " |",
             "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(BATCH)]

    def gbs(r: dict | None) -> str:
        return f"{r['achieved_gbs']:.1f}" if r else "-"

    def pct(r: dict | None) -> str:
        return f"{r['pct_ceiling']:.0f}%" if r and r.get("pct_ceiling") else "-"

    def ratio(quant: str, m: int, layer: str) -> str:
        key = ("edge-avx512", quant, m, layer)
        return f"{seconds(key) / seconds(key[:2] + (1, layer)):.2f}x" if key in by else "not run"

    def ms(engine: str, quant: str, layer: str) -> str:
        key = (engine, quant, 8, layer)
        return f"{seconds(key) * 1e3:.3f}" if key in by else "not run"

    for layer in LAYERS:
        a16 = by[("edge-avx512", "w4a16", 1, layer)]
        a8 = by[("edge-avx512", "w4a8", 1, layer)]
        fl = by[("F.linear", "bf16", 1, layer)]
        single = " / ".join(f"{gbs(one_thread.get(('gemm', q, layer)))}, "
                            f"{gbs(one_thread.get(('gemmloop', q, layer)))}"
                            for q in ("w4a16", "w4a8")) if one_thread else "not run"
        l16, l8 = loop.get(("w4a16", 1, layer)), loop.get(("w4a8", 1, layer))
        at8 = " / ".join(ms(e, q, layer) for e, q in (("edge-avx512", "w4a16"), ("edge-avx512", "w4a8"),
                                                      ("F.linear", "bf16")))
        lines.append(f"| {layer} | {a16['extra']['n']}x{a16['extra']['k']} | {gbs(a16)} / {gbs(l16)} | "
                     f"{gbs(a8)} / {gbs(l8)} | {pct(l16)} / {pct(l8)} | {single} | {gbs(fl)} | {at8} | "
                     + " | ".join(f"{ratio('w4a16', m, layer)} / {ratio('w4a8', m, layer)}" for m in BATCH)
                     + " |")
    return "\n".join(lines + [""])


def main() -> int:
    return rewrite(PAGE, START, END, block(bench_records()), "--check" in sys.argv,
                   f"{PAGE.relative_to(ROOT)}: the kernel table differs from the records; "
                   "run python3 tools/kernel_table.py")


if __name__ == "__main__":
    sys.exit(main())
