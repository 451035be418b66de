#!/usr/bin/env python3
"""docs/analysis/decode.md's ablation table, generated from docs/results/bench.jsonl.

One row per decode lever: the run that first measured it, our qwen3-0.6b-random w4a16-head
tg128 (median, min-max, ms per step) and llama.cpp Q4_K_M's tg128 from the same interleaved
run. Runs differ in how fast the shared machine was (llama.cpp itself moved 52.7-61.6 tok/s
between them), so the lever is read in the ratio column, never across rows of absolute tok/s.
`python3 tools/decode_ablation.py` rewrites the block between the markers; `--check` fails
when the committed block differs from what the records give.
"""

from __future__ import annotations

import sys

from generated_block import ROOT, bench_records, cell, rewrite

from edge_harness.report.render import noise_verdict

PAGE = ROOT / "docs" / "analysis" / "decode.md"
START, END = "<!-- ablation:start (tools/decode_ablation.py) -->", "<!-- ablation:end -->"
MODEL = "qwen3-0.6b-random"
# (run, our build's options in that run, the lever it measured)
LEVERS = (
    ("20261201T042040-4112", {}, "our kernels as the torch op `edge_w4::linear`, eager, bf16 activations"),
    ("20261201T042934-2160", {"act_dtype": "float32"}, "... with fp32 activations (eager)"),
    ("20261201T042934-2160", {"compiled": True}, "vLLM's compiled mode (inductor), bf16"),
    ("20261201T045231-9440", {}, "+ small-M one-pass kernels, `vdpbf16ps` GEMV (blocks64)"),
    ("20261201T045231-9440", {"act_dtype": "float32"}, "... the same with fp32 activations (compiled)"),
    ("20261201T091316-5856", {},
     "+ words128 layout, 4 rows x T tokens per call, prefetch 8 KiB, bf16 prefill GEMM"),
    ("20261201T121231-3536", {"fused": False}, "the same build, measured again (`@fused=0`)"),
    ("20261201T121231-3536", {},
     "+ fused decode: two C++ ops per layer around vLLM's attention ops, eager"),
    ("20261201T122653-7248", {}, "+ one op per layer (`edge_w4::decode_layer`), attention called from C++"),
)


def _row(records: list[dict], run: str, options: dict, label: str) -> str:
    tg = [r for r in records
          if r.get("run_id") == run and r.get("model") == MODEL and r.get("test") == "tg128"]
    ours = next(r for r in tg if (r["engine"], r["quant"]) == ("ours", "w4a16-head")
                and r.get("extra", {}).get("options", {}) == options)
    ref = next(r for r in tg if (r["engine"], r["quant"]) == ("llama.cpp", "q4_k_m"))
    dirty = " (dirty)" if ours.get("git_dirty") else ""
    return (f"| {label} | {cell(ours)} | {1000 / ours['median']:.1f} | {cell(ref)} | "
            f"**{ours['median'] / ref['median']:.2f}x** {noise_verdict(ours['samples'], ref['samples'])}"
            f" | `{run}` {ours['git_commit'][:7]}{dirty} |")


def block(records: list[dict]) -> str:
    lines = ["",
             f"{MODEL}, ours w4a16-head against llama.cpp Q4_K_M, tg128, 2 threads on cores 0-1, "
             "medians of 3 interleaved repetitions (min-max); the command of each run is in its records.",
             "",
             "| lever | ours tok/s | ms/token | llama.cpp tok/s (same run) | ratio | run, commit |",
             "|---|---:|---:|---:|---:|---|"]
    lines += [_row(records, *lever) for lever in LEVERS]
    return "\n".join(lines + [""])


def main() -> int:
    return rewrite(PAGE, START, END, block(bench_records()), "--check" in sys.argv,
                   f"{PAGE.relative_to(ROOT)}: the ablation table differs from the records; "
                   "run python3 tools/decode_ablation.py")


if __name__ == "__main__":
    sys.exit(main())
