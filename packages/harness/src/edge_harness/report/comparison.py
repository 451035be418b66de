"""docs/engines/comparison.md, generated from docs/results/*.jsonl (never typed by hand):

    python -m edge_harness.report.comparison docs/results docs/engines/comparison.md

Speed (bench.jsonl: ours / llama.cpp medians, % of the streaming ceiling), serving under load
(serve.jsonl), fidelity (fidelity.jsonl), task quality (tasks.jsonl), the phone path
(export.jsonl), each with where and how it was measured, then what the comparisons do not
establish.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edge_harness.record import read_records
from edge_harness.report.printers import md_table
from edge_harness.report.render import (
    REFERENCE,
    fill_ceiling,
    is_speed,
    latest,
    latest_per_machine,
    machine_label,
    noise_verdict,
    ratio_table,
)

NOT_ESTABLISHED = """## What the comparisons do not establish

- **Other CPUs.** Every figure here is from a 2-core VM shared with other work: an AMD Zen 3
  (AVX2 only), an AMD with AVX-512 (VNNI, bf16) or an Intel Xeon, as each table's machine
  column or line names; none had AMX. The contention guard refused busy measurements, but a VM's
  memory bandwidth and turbo behaviour vary between runs. Ratios measured in one interleaved run
  carry over better than absolute tok/s.
- **ARM.** Nothing was measured on ARM (phones, Graviton, Apple): the phone path's `.pte` is
  timed on this x86 CPU only (the ExecuTorch section), and QNN figures are simulated unless a
  record says `measured: device`.
- **AMX.** vLLM's own AMX 4-bit kernel and the seed's AMX figures are not reproduced here; no
  CPU of these runs had AMX. The AVX-512 rows come from 2-core VMs, not from a server socket.
- **Real weights for speed.** Speed is measured on random weights of real shapes (qwen3-0.6b,
  Spark-X2.5-1.7B) and on smollm2-135m; decode speed does not depend on the values, fidelity does.
- **Fidelity of the formats in general.** The trained reference weights were already 4-bit
  (smollm2: Q4_1 groups of 32; qwen2.5-coder: Q4_K_M). Re-quantizing onto the grid they came
  from is nearly lossless and flatters that format; each fidelity table names its grid.
- **Equal bits.** Formats store different bits per weight (scales, zero points, which tensors
  stay in 8 or 16 bits); every row states its bits/weight, counted from the files. A faster or
  more faithful build at more bits/weight is a different trade, not a win.
- **Serving in general.** The serving rows are one seeded random workload per model on 2
  cores, each server with one slot per concurrent request; other length mixes, longer windows,
  shared prefixes and more cores can rank the servers differently.
- **Tasks beyond HumanEval.** pass@1 is one benchmark of 164 short Python problems, greedy; its
  95% intervals are wide, and a flip count says more about a 4-bit build than the pass@1 gap.
"""


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def speed_section(results: Path) -> str:
    path = results / "bench.jsonl"
    if not path.is_file():
        return "## Speed\n\n(no bench.jsonl: run `nox -s bench-x86`)\n"
    everything = read_records(path)
    shown = latest_per_machine(everything)  # a newer run on one CPU hides no other CPU's
    fill_ceiling(shown)
    speed = [r for r in shown if is_speed(r)]
    if not speed:
        return "## Speed\n\n(no pp/tg records)\n"
    cpus = sorted({f"{r.cpu_model}, {r.isa} ({' '.join(r.cpu_flags)})" for r in speed})
    threads = sorted({r.threads for r in speed})
    versions = sorted({r.engine_version.split(" (")[0] for r in speed if r.engine in ("ours", *REFERENCE)})
    commands = list(dict.fromkeys(r.command for r in speed if r.command))
    reps = sorted({len(r.samples) for r in speed})
    guard = sorted({r.guard for r in speed})
    lines = ["## Speed: ours / llama.cpp", "",
             f"Machine: {'; '.join(cpus)}; threads {threads} (one per physical core, same cores "
             f"for every engine); medians of {reps} repetitions after a warm-up, engines "
             f"interleaved; contention guard: {', '.join(guard)}.", "",
             f"Versions: {'; '.join(versions)}.", "",
             "Commands: " + "; ".join(f"`{c}`" for c in commands), "",
             "Each ratio pairs the newest record of ours on each machine with llama.cpp's record "
             "from the same run (interleaved, same machine state); a pair never spans two runs. "
             "llama.cpp is "
             "timed by llama-bench itself where the run did so (engine llama-bench), else by our "
             "llama.cpp runner.", "",
             ratio_table(shown, everything), "",
             "Decode against the streaming-read ceiling (achieved GB/s = bytes of weights read per "
             "token x tok/s):", ""]
    tg = sorted((r for r in speed if r.test.startswith("tg") and r.achieved_gbs is not None),
                key=lambda r: (r.model, machine_label(r), r.engine, r.build))
    lines.append(md_table(
        ["model", "engine", "quant", "bits/weight", "tok/s (median)", "GB/s", "% of ceiling",
         "machine"],
        [[r.model, r.engine, r.build, f"{r.bits_per_weight:.2f}" if r.bits_per_weight else "",
          f"{r.median:.2f}", f"{r.achieved_gbs:.2f}",
          f"{r.pct_ceiling:.1f}" if r.pct_ceiling is not None else "", machine_label(r)]
         for r in tg]))
    return "\n".join(lines) + "\n"


def executorch_section(results: Path) -> str:
    """The phone engine on this CPU: each ExecuTorch (XNNPACK .pte) record of the newest run per
    (model, build, test), beside every other engine's record of the same run and test."""
    title = "## The phone engine on this CPU: ExecuTorch (XNNPACK)"
    path = results / "bench.jsonl"
    everything = [r for r in read_records(path) if is_speed(r)] if path.is_file() else []
    et = latest([r for r in everything if r.engine == "executorch"])
    if not et:
        return f"{title}\n\n(no executorch records: run `nox -s bench-x86`)\n"
    rows = []
    for r in sorted(et, key=lambda r: (r.model, r.build, r.test[:2] != "pp", r.test)):
        others = sorted((x for x in everything if x.run_id == r.run_id and x.model == r.model
                         and x.test == r.test and x.threads == r.threads
                         and x.engine != "executorch"), key=lambda x: (x.engine, x.build))
        beside = "; ".join(f"{x.engine} {x.build} {x.median:.2f} ({r.median / x.median:.2f}x, "
                           f"{noise_verdict(r.samples, x.samples)})" for x in others)
        rows.append([r.model, r.build, r.test, f"{r.bits_per_weight:.2f}",
                     f"{r.median:.2f} ({min(r.samples):.2f}-{max(r.samples):.2f})",
                     beside or "-"])
    cpus = sorted({f"{r.cpu_model}, {r.isa}" for r in et})
    versions = sorted({r.engine_version for r in et})
    facts = et[0].extra.get("facts", {})
    commands = list(dict.fromkeys(r.command for r in et if r.command))
    lines = [title, "",
             "The `.pte` that `nox -s export` lowers for phones, timed on this CPU with llama-bench's "
             "pp/tg by `edge-infer bench run` (engine `executorch`, "
             "packages/harness/src/edge_harness/runners/executorch.py), interleaved with the other "
             "engines of the same run on the same pinned cores. Its graph has a static cache of "
             f"{facts.get('static_context', '?')} slots that every call attends over (prefill in "
             f"chunks of {facts.get('prefill_chunk', '?')}), as a phone deployment of it would. "
             "Each ratio is ExecuTorch's tok/s over the other engine's, same run; 'faster' or "
             "'slower' only where the repetitions' ranges do not overlap.", "",
             f"Machine: {'; '.join(cpus)}; threads {sorted({r.threads for r in et})}; guard: "
             f"{', '.join(sorted({r.guard for r in et}))}. Versions: {'; '.join(versions)}.", "",
             "Commands: " + "; ".join(f"`{c}`" for c in commands) + "; commits "
             + ", ".join(sorted({(r.git_commit or "?")[:7] + (" (dirty)" if r.git_dirty else "")
                                 for r in et})) + ".", "",
             md_table(["model", "build", "test", "bits/weight", "tok/s median (min-max)",
                       "same run: engine build tok/s (ExecuTorch / it)"], rows)]
    return "\n".join(lines) + "\n"


def fidelity_section(results: Path) -> str:
    from edge_harness.fidelity.render import latest

    path = results / "fidelity.jsonl"
    recs = {(r["model"], r["engine"], r["quant"]): r for r in latest(path)} if path.is_file() else {}
    if not recs:
        return "## Fidelity\n\n(no fidelity.jsonl: run `nox -s fidelity`)\n"
    rows = []
    order = sorted(recs.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[1]["bits_per_weight"]))
    for (model, engine, quant), r in order:
        greedy = f"{r['greedy_exact']}/{r['greedy_prompts']}" if r["greedy_prompts"] else "-"
        rows.append([model, r["source_grid"].split(" (")[0], engine, quant, r["base"],
                     f"{r['bits_per_weight']:.2f}", greedy, f"{r['same_top_pct']:.2f}",
                     f"{r['kl_mean']:.5f}", f"{r['kl_p99']:.4f}", f"{r['ppl_ratio']:.4f}",
                     f"{r['machine'].get('cpu_model')} ({r['machine'].get('isa')})"])
    any_rec = next(iter(recs.values()))
    cmds = sorted({r["command"] for r in recs.values() if r.get("command")})
    crosscheck = [r for r in _read_jsonl(results / "fidelity.jsonl") if r.get("kind") == "crosscheck"]
    lines = ["## Fidelity: each build against its own engine's full precision", "",
             "Each row names the machine of its newest record (a build and its base on the "
             "same one). llama-perplexity's statistics over lee + shakespeare chunks of "
             f"{any_rec['n_ctx']} tokens; greedy = exact reproductions of 12 chat prompts. "
             "Details: [../results/fidelity.md](../results/fidelity.md).", "",
             "Commands: " + "; ".join(f"`{c}`" for c in cmds), "",
             md_table(["model", "weights came from", "engine", "build", "vs", "bits/weight",
                       "greedy", "same top %", "mean KL", "KL p99", "PPL ratio", "machine"], rows)]
    if crosscheck:
        c = crosscheck[-1]
        lines += ["", f"Cross-check against `llama-perplexity --kl-divergence` ({c['model']} "
                  f"llama.cpp {c['quant']} vs F16, {c['corpus']} x {c['chunks']} chunks): mean KL "
                  f"ours {c['ours']['kl_mean']:.6f} vs tool {c['llama_perplexity']['kl_mean']:.6f}, "
                  f"same top ours {c['ours']['same_top_pct']:.3f}% vs tool "
                  f"{c['llama_perplexity']['same_top_pct']:.3f}% "
                  f"({'agree' if c['agree'] else 'DISAGREE'} within {c['tolerance']:.0%})."]
    return "\n".join(lines) + "\n"


def serve_section(results: Path) -> str:
    """ours / llama-server at each concurrency, from serve.jsonl's newest run per model."""
    from edge_harness.report import serve

    path = results / "serve.jsonl"
    shown = serve.newest_runs(read_records(path, kind=serve.KIND)) if path.is_file() else []
    if not shown:
        return "## Serving under load\n\n(no serve.jsonl: run `nox -s bench-serve`)\n"
    rows = []
    # one table per (model, workload, machine): every row names its machine
    for (_, prefix, _), rs in serve.tables(shown):
        mine = sorted(rs, key=serve.order)
        workload = f"shared prefix {prefix}" if prefix else "random"
        rows += [[row[0], workload, machine_label(mine[0]), *row[1:]]
                 for row in serve.ratio_rows(mine)]
    return ("## Serving under load: ours / llama-server\n\nOutput throughput (> 1: ours serves "
            "more) and p99 time to first token (< 1: ours answers sooner) at each concurrency, "
            "vLLM's serving client against both servers, one at a time on the same cores of "
            "the machine named. Details, latencies, runs and commands: "
            "[../results/serve.md](../results/serve.md).\n\n"
            + md_table(["model", "workload", "machine", "concurrency", "pair", "output tok/s ratio",
                        "TTFT p99 ratio"], rows) + "\n")


def tasks_section(results: Path) -> str:
    """HumanEval pass@1 of each build, from tasks.jsonl's newest records."""
    from edge_harness.tasks.render import latest as latest_tasks
    from edge_harness.tasks.render import run_size

    path = results / "tasks.jsonl"
    recs = latest_tasks(path) if path.is_file() else []
    if not recs:
        return "## Task quality\n\n(no tasks.jsonl: run `nox -s eval-tasks`)\n"
    rows = []
    for r in sorted(recs, key=lambda r: (r["model"], run_size(r), r["engine"],
                                         -r["server"].get("bits_per_weight", 0))):
        lo, hi = r["pass_at_1_ci95"]
        bits = r["server"].get("bits_per_weight")
        rows.append([r["model"], r["engine"], r["quant"], f"{bits:.2f}" if bits else "-",
                     f"{r['pass_at_1']:.3f}", f"{lo:.3f}–{hi:.3f}",
                     f"{r['passed']}/{r['problems']}", str(run_size(r)[2])])
    return ("## Task quality: HumanEval pass@1 per build\n\nEach build served by its own "
            "engine's server, greedy, the code run in our sandbox; paired flips against each "
            "engine's full precision and the fidelity rows beside them: "
            "[../analysis/tasks.md](../analysis/tasks.md).\n\n"
            + md_table(["model", "engine", "build", "bits/weight", "pass@1", "95% CI", "passed",
                        "in flight"], rows) + "\n")


def _calibration(c) -> str:
    if not c:
        return "none"
    if isinstance(c, dict):
        return f"{c.get('corpus', '?')} x {c.get('samples', '?')}"
    return str(c)


def export_section(results: Path) -> str:
    recs = {}
    for r in _read_jsonl(results / "export.jsonl"):
        if r.get("measured") == "eager":
            # an ablation variant (export --ablate), not an export of the target: its scheme
            # may not even be the target's (8da8w); export.md has them in their own table
            continue
        key = (r.get("model"), r.get("target"), json.dumps(r.get("calibration"), sort_keys=True),
               r.get("sink_prefix") is not None)
        recs[key] = r
    if not recs:
        return "## Phone path\n\n(no export.jsonl: run `nox -s export`)\n"
    rows = [[r.get("model"), r.get("target"), _calibration(r.get("calibration")),
             f"{r['sqnr_db']:.1f}" if r.get("sqnr_db") is not None else "", r.get("measured", ""),
             r.get("needs") or ""] for r in recs.values()]
    sinks = ["yes" if r.get("sink_prefix") else "no" for r in recs.values()]
    return ("## Phone path: SQNR of each export target\n\nSQNR of logits against the float "
            "eager model, in dB (higher is better). Details: "
            "[../results/export.md](../results/export.md).\n\n"
            + md_table(["model", "target", "calibration", "sink prefix", "SQNR dB", "measured", "needs"],
                       [row[:3] + [sink] + row[3:] for row, sink in zip(rows, sinks, strict=True)]) + "\n")


def render(results: Path) -> str:
    parts = ["# Where our numbers sit", "",
             "Generated by `nox -s docs` (`python -m edge_harness.report.comparison docs/results "
             "docs/engines/comparison.md`) from the JSONL records in `docs/results/`; do not edit "
             "by hand. Engine pages: [llama.cpp](llama.cpp.md), [vLLM](vllm.md), "
             "[ExecuTorch](executorch.md), [MNN](mnn.md), [ncnn](ncnn.md).", "",
             speed_section(results), executorch_section(results), serve_section(results),
             fidelity_section(results),
             tasks_section(results), export_section(results),
             NOT_ESTABLISHED]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m edge_harness.report.comparison RESULTS_DIR OUT.md", file=sys.stderr)
        return 2
    out = Path(args[1])
    out.write_text(render(Path(args[0])))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
