"""`edge-infer bench crosscheck`: the real `llama-bench` beside our llama.cpp runner.

runners/llamacpp.py re-implements llama-bench's loop (so that llama.cpp runs in the same pinned,
guarded, interleaved harness as our engine); this checks that it measures what llama-bench
measures. Same GGUF, same cores, same thread count, under the same contention guard, alternating
R times:
  1. one `llama-bench -m GGUF -p P -n N -r 1 -t T -o json` (its own warm-up, then pp and tg
     once; its defaults otherwise, as people quote it), pinned to the cores;
  2. one repetition of pp P and tg N by our runner, in a pinned child loaded once (warmed up
     once per test before the first round, as `bench run` does).
One record per test (kind "llama_bench_crosscheck") holds llama-bench's per-invocation t/s as
its samples and our runner's in extra["ours"], both medians with min-max, the ratio
ours/llama-bench and a verdict: "agree" when the medians are within ±5% of each other (the
integrity issue's bar; overlapping min-max ranges alone do not make two readings agree). The
verdict is recorded, not asserted: it is a benchmark, not a test.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edge_harness.bench.llama_tools import LLAMA_BENCH as TOOL
from edge_harness.bench.llama_tools import llama_bench_args, parse_llama_bench, tool_env, tool_path
from edge_harness.bench.run import Bench, Isolation, Plan, resolve_model, say
from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.record import Record, summarize
from edge_harness.runners.llamacpp import LlamaCppRunner
from edge_infer.api import EdgeInferError, Guard, UsageError, Verdict, choose_cores

KIND = "llama_bench_crosscheck"
TOLERANCE = 0.05  # medians within ±5%


@dataclass
class CrosscheckPlan(Isolation):
    model: str
    quant: str = "q4_k_m"
    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 3
    threads: int | None = None
    cores: str | None = None
    seed: int = 0

    @property
    def tests(self) -> list[tuple[str, int]]:
        return [(t, n) for t, n in (("pp", self.n_prompt), ("tg", self.n_gen)) if n > 0]


def run_llama_bench(binary: Path, gguf: str, plan: CrosscheckPlan, cores: list[int],
                    guard: Guard, what: str) -> tuple[dict[str, dict], tuple[str, object]]:
    """One pinned, watched invocation; (parsed entries, (guard status, reading))."""
    args = llama_bench_args(binary, gguf, plan.n_prompt, plan.n_gen, len(cores))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=tool_env(binary),
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))
        with guard.watch(proc.pid) as watch:
            # Wait without reaping: the watch's last sample must still read the exited
            # process's CPU time (a reaped one reads as nothing, and its work as foreign load).
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        rc = proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if rc != 0:
        raise EdgeInferError(f"{TOOL} exited {rc} ({' '.join(args)}):\n"
                             + "\n".join((stderr or stdout).strip().splitlines()[-10:]))
    return parse_llama_bench(stdout, len(cores)), (guard.judge(watch.reading, what), watch.reading)


def spread(samples: list[float]) -> dict[str, float]:
    _, _, median = summarize(samples)
    return {"median": median, "min": min(samples), "max": max(samples)}


def compare(ours: list[float], theirs: list[float]) -> dict:
    """Both medians with min-max, ratio ours/llama-bench, and the verdict."""
    a, b = spread(ours), spread(theirs)
    ratio = a["median"] / b["median"]
    overlap = a["min"] <= b["max"] and b["min"] <= a["max"]
    agree = abs(ratio - 1) <= TOLERANCE
    return {"ours": a, "llama_bench": b, "ratio": round(ratio, 4), "ranges_overlap": overlap,
            "tolerance": TOLERANCE, "verdict": "agree" if agree else "disagree"}


def crosscheck(plan: CrosscheckPlan) -> list[Record]:
    if plan.reps < 1:
        raise UsageError("-r must be at least 1")
    if not plan.tests:
        raise UsageError("nothing to measure: -p and -n are both 0")
    cores = choose_cores(plan.cores, plan.threads)
    threads = len(cores)
    model = resolve_model(plan.model)
    build = LlamaCppRunner.prepare(model, plan.quant)
    binary = tool_path(TOOL)  # built once (minutes), before the lock and the guard
    bench = Bench(Plan(models=[plan.model], engines=[], results=plan.results,
                       command=plan.command))
    n_ctx = max(plan.n_prompt, plan.n_gen + 1)
    theirs: dict[str, list[dict]] = {t: [] for t, _ in plan.tests}
    ours: dict[str, list[float]] = {t: [] for t, _ in plan.tests}
    with bench_lock(plan.lock_wait):
        guard = Guard(cores, plan.threshold, plan.window, plan.force, plan.wait)
        verdicts: dict[str, Verdict] = {t: guard.verdict() for t, _ in plan.tests}
        status, reading = guard.check_idle("the crosscheck")
        say(f"guard: cores {cores} idle check {status} ({reading.describe()})")
        say(f"load {model.name} llama.cpp:{plan.quant} (our runner) on cores {cores}")
        with Worker(cores, LlamaCppRunner.child_env(cores, threads, {}),
                    label=f"{model.name}-crosscheck") as worker:
            facts = worker.request("load", engine="llama.cpp", build=build.to_dict(),
                                   threads=threads, n_ctx=n_ctx)["facts"]
            if facts["threads"] != threads:
                raise EdgeInferError(f"our runner reports {facts['threads']} threads, asked "
                                     f"for {threads}")
            for test, n in plan.tests:  # one warm-up per test, untimed, as `bench run`
                worker.request(test, n=n, seed=plan.seed * 1000 + 999)
            for rep in range(plan.reps):
                what = f"{TOOL} of {model.name} {plan.quant} (repetition {rep + 1})"
                before = guard.check_idle(what)
                for v in verdicts.values():
                    v.add(*before)
                entries, (status, reading) = run_llama_bench(binary, build.path, plan, cores,
                                                             guard, what)
                for test, _ in plan.tests:
                    if test not in entries:
                        raise EdgeInferError(f"{TOOL} printed no {test} result")
                    theirs[test].append(entries[test])
                    verdicts[test].add(status, reading)
                for test, n in plan.tests:
                    what = f"{test}{n} of {model.name} llama.cpp:{plan.quant} (repetition {rep + 1})"
                    secs = guard.measure(worker.pid, what, verdicts[test], worker.request, test,
                                         n=n, seed=plan.seed * 1000 + rep, say=say)["seconds"]
                    ours[test].append(n / secs)
                say(f"[{rep + 1}/{plan.reps}] " + "  ".join(
                    f"{t}{n}: {TOOL} {theirs[t][-1]['avg_ts']:.2f}, runner {ours[t][-1]:.2f} t/s"
                    for t, n in plan.tests))
    records = []
    for test, n in plan.tests:
        lb = theirs[test]
        samples = [e["avg_ts"] for e in lb]
        first = lb[0]
        rec = bench.record(
            kind=KIND, engine=TOOL,
            engine_version=f"{TOOL} {first.get('build_commit')} (build {first.get('build_number')})",
            model=model.name, quant=plan.quant, test=f"{test}{n}", samples=samples, unit="tok/s",
            bits_per_weight=round(build.bits_per_weight, 4),
            n_prompt=n if test == "pp" else 0, n_gen=n if test == "tg" else 0,
            threads=threads, cores=cores, **verdicts[test].fields(),
            extra={**compare(ours[test], samples),
                   "ours_samples": ours[test], "ours_engine": "llama.cpp",
                   "ours_version": facts["version"], "ours_facts": facts,
                   "build_commit": first.get("build_commit"),
                   "build_number": first.get("build_number"),
                   "llama_bench_json": lb, "gguf": Path(build.path).name,
                   "versions": _versions()},
        )
        bench.emit(rec)
        records.append(rec)
    return records


def _versions() -> dict[str, str]:
    from edge_infer.api import versions

    return versions("edge-infer", "edge-infer-harness", "llama-cpp-python")


def table(records: list[Record]) -> str:
    from edge_harness.report.printers import md_table

    def fmt(s: dict) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    # the verdict by today's rule, from the samples (a record keeps the one of its day)
    rows = [[r.model, r.quant, str(r.threads), r.test, fmt(r.extra["llama_bench"]),
             fmt(r.extra["ours"]), f"{r.extra['ratio']:.3f}",
             compare(r.extra["ours_samples"], r.samples)["verdict"], r.guard]
            for r in records]
    return md_table(["model", "quant", "threads", "test", "llama-bench t/s (min-max)",
                     "our runner t/s (min-max)", "ours/llama-bench", "verdict", "guard"], rows)
