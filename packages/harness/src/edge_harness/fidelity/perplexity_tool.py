"""llama.cpp's own `llama-perplexity --kl-divergence` (built by edge_harness.bench.llama_tools
from the llama-cpp-python sdist we link), and the cross-check of our llama.cpp numbers against it.

Same text, same GGUFs, same chunking: llama-perplexity tokenizes the corpus text file with the
model's tokenizer (add_special on), cuts chunks of n_ctx, puts BOS first when the vocabulary
adds one and scores positions n_ctx/2 .. n_ctx-2; edge_harness.fidelity.chunks does the same,
so both score identical token ids. Known differences, each small: llama-perplexity stores the
base log-probs quantized to 16 bits (we keep float32), and it evaluates 4 chunks per batch
(n_batch 2048 / n_ctx 512) where we evaluate one.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from edge_harness.bench.llama_tools import tool_env, tool_path
from edge_infer.api import EdgeInferError

TOOL = "llama-perplexity"

# "Mean    KLD:   0.012345 ±   0.000123", "Same top p: 93.456 ± 0.123 %", "99.0%   KLD: ..."
PATTERNS = {
    "kl_mean": r"Mean\s+KLD:\s+(-?[\d.]+)",
    "kl_p99": r"99\.0%\s+KLD:\s+(-?[\d.]+)",
    "kl_median": r"Median\s+KLD:\s+(-?[\d.]+)",
    "kl_max": r"Maximum\s+KLD:\s+(-?[\d.]+)",
    "same_top_pct": r"Same top p:\s+([\d.]+)",
    "ppl_test": r"Mean PPL\(Q\)\s+:\s+([\d.]+)",
    "ppl_base": r"Mean PPL\(base\)\s+:\s+([\d.]+)",
    "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s+:\s+([\d.]+)",
}


def parse(output: str) -> dict[str, float]:
    out = {}
    for key, pat in PATTERNS.items():
        m = re.search(pat, output)
        if m:
            out[key] = float(m.group(1))
    missing = [k for k in ("kl_mean", "same_top_pct") if k not in out]
    if missing:
        raise EdgeInferError(f"{TOOL} printed no {', '.join(missing)}; its output ended:\n"
                             + "\n".join(output.strip().splitlines()[-10:]))
    return out


def run_tool(base_gguf: Path, test_gguf: Path, text: str, chunks: int, n_ctx: int,
             cores: list[int], workdir: Path) -> dict[str, float]:
    binary = tool_path(TOOL)
    text_file = workdir / "corpus.txt"
    text_file.write_text(text, encoding="utf-8")
    kld = workdir / "base.kld"
    common = ["-c", str(n_ctx), "-t", str(len(cores)), "-fa", "on"]
    env = tool_env(binary)
    pin = lambda: os.sched_setaffinity(0, cores)  # noqa: E731
    for args in ([str(binary), "-m", str(base_gguf), "-f", str(text_file), "--chunks", str(chunks),
                  "--kl-divergence-base", str(kld), *common],
                 [str(binary), "-m", str(test_gguf), "--kl-divergence-base", str(kld),
                  "--kl-divergence", *common]):
        proc = subprocess.run(args, env=env, capture_output=True, text=True, preexec_fn=pin)
        if proc.returncode != 0:
            raise EdgeInferError(f"{TOOL} exited {proc.returncode}: "
                                 + "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:]))
    return parse(proc.stdout + proc.stderr)


def crosscheck(model_name: str, quant: str, corpus: str, chunks: int, n_ctx: int,
               tolerance: float, results: Path | None) -> bool:
    from edge_harness.bench.run import parse_engine, resolve_model
    from edge_harness.fidelity.run import FidelityPlan, FidelityRun
    from edge_harness.runners import get_runner
    from edge_infer.api import Guard, append, command_line, context, corpus_text

    plan = FidelityPlan(models=[model_name], builds=[parse_engine(f"llama.cpp:{quant}")],
                        corpora=[corpus], chunks=chunks, n_ctx=n_ctx, prompts=0, results=None)
    run = FidelityRun(plan)
    (ours,) = run.run()
    model = resolve_model(model_name)
    llama_cpp = get_runner("llama.cpp")
    base = llama_cpp.prepare(model, llama_cpp.full_precision)
    test = llama_cpp.prepare(model, quant)
    with (tempfile.TemporaryDirectory(prefix="kld-") as tmp,
          Guard(run.cores).observe(f"{TOOL} {quant}") as verdict):
        tool = run_tool(Path(base.path), Path(test.path), corpus_text(corpus), chunks, n_ctx,
                        run.cores, Path(tmp))
    rel = {k: abs(ours[k] - tool[k]) / max(abs(tool[k]), 1e-12) for k in ("kl_mean", "same_top_pct")}
    ok = all(v <= tolerance for v in rel.values())
    print(f"{model_name} llama.cpp:{quant} vs f16, {corpus} x {chunks} chunks of {n_ctx}:")
    for k in ("kl_mean", "same_top_pct", "kl_p99", "ppl_ratio"):
        if k in tool:
            extra = f"  (relative difference {rel[k]:.4%})" if k in rel else ""
            print(f"  {k:13s} ours {ours[k]:.6f}  {TOOL} {tool[k]:.6f}{extra}")
    print(f"  {'agree' if ok else 'DISAGREE'} within {tolerance:.1%}")
    if results is not None:
        append(results, {"kind": "crosscheck", **context(threads=len(run.cores)),
                         **verdict.fields(), "cores": run.cores, "command": command_line(),
                         "model": model_name, "quant": quant, "corpus": corpus, "chunks": chunks,
                         "n_ctx": n_ctx, "ours": {k: ours[k] for k in tool if k in ours},
                         "llama_perplexity": tool, "relative_difference": rel,
                         "tolerance": tolerance, "agree": ok})
    return ok
