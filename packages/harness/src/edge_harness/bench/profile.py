"""`edge-infer bench profile`: where one decode step of our engine spends its time.

One build of one model is loaded in a pinned child (as `bench run` loads it); tg(n) runs under
torch's profiler (see OursRunner.profile). The record keeps the decode time per step, the part
inside torch ops and our kernels (self CPU time on the engine thread), and the largest ops; the
remainder is Python and vLLM bookkeeping between ops. Records go to profile.jsonl beside the
bench results; `render` makes the markdown table that docs/analysis quotes.
"""

from __future__ import annotations

from pathlib import Path

from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.runners import get_runner, locate, runners
from edge_infer.api import UsageError, append, choose_cores, context, latest, read


def run(model_name: str, engine: str, quant: str, n: int, cores_arg, threads, results: Path | None,
        command: str, lock_wait: float, say=print, options: dict | None = None, batch: int = 1,
        guard: dict | None = None) -> dict:
    """One profiled tg`n` of our engine, `batch` sequences decoded together in each step;
    `options` as bench run's `@key=value` (e.g. fused); `guard` the contention guard's
    settings (threshold, window, force, wait), as bench run's flags."""
    from edge_harness.bench.run import resolve_model
    from edge_infer.api import Guard

    runner = get_runner(engine)
    if not runner.profiler:
        having = sorted(n for n, r in runners().items() if r.profiler)
        raise UsageError(f"bench profile: {engine} has no op profiler (its runner declares "
                         f"profiler = False; its step time is in bench run's tg); engines with "
                         f"one: {', '.join(having)}")
    if batch < 1:
        raise UsageError(f"--batch must be at least 1, got {batch}")
    if not runner.accepts(quant):
        raise UsageError(f"{engine} has no quant {quant!r}; it offers {', '.join(runner.quants)}")
    model = resolve_model(model_name)
    cores = choose_cores(cores_arg, threads)
    options = options or {}
    build = runner.prepare(model, quant)
    options = {**options, "max_num_seqs": batch}  # the engine admits `batch` sequences per step
    build = type(build)(**{**build.to_dict(), "options": options})
    with bench_lock(lock_wait):
        say(f"profile {model.name} {engine}:{quant}: tg{n} x batch {batch} under torch's profiler "
            f"on cores {cores}")
        with Worker(cores, runner.child_env(cores, len(cores), options), label="profile") as w:
            facts = w.request("load", engine=locate(runner), build=build.to_dict(), threads=len(cores),
                              n_ctx=n + 16)["facts"]
            g = Guard(cores, **(guard or {}))
            what = f"the profile of {model.name} {engine}:{quant}"
            verdict = g.verdict()
            prof = g.measure(w.pid, what, verdict, w.request, "profile", engine=engine, n=n,
                             seed=0, batch=batch, say=say)["result"]
    step_ms = prof["decode_s"] / n * 1e3
    rec = {"kind": "profile", **context(threads=len(cores)), "command": command,
           "model": model.name, "engine": engine, "quant": quant, "engine_version": facts["version"],
           "cores": cores, "w4_kernels": facts.get("w4_kernels", {}), "options": options,
           "fused_decode": facts.get("fused_decode"), "batch": batch, "step_ms": step_ms,
           **verdict.fields(), **prof}
    if results is not None:
        append(results, rec)
    say(f"  {step_ms:.2f} ms per decode step of {batch}; in torch ops + our kernels "
        f"{prof['in_ops_s'] / prof['wall_s'] * 100:.0f}% of the profiled wall time")
    return rec


def _group(op: str) -> str:
    if op.startswith("edge_w4::"):
        return "our 4-bit kernels"
    if op in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul"):
        return "bf16 GEMM (unquantized layers)"
    if "attention" in op.lower() or "paged" in op.lower() or op.startswith("_C::"):
        return "vLLM C++ ops (attention, cache, norms, activations)"
    return "other torch ops"


def render(path: Path) -> str:
    """Markdown: per (model, build), the newest profile's split of one decode step."""
    def key(r: dict) -> tuple:
        return r["model"], r["engine"], r["quant"], r.get("batch", 1)

    recs = latest([r for r in read(path, what="profile record") if r.get("kind") == "profile"], key)
    out = []
    for r in sorted(recs, key=key):
        model, engine, quant, batch = key(r)
        wall_ms = r["wall_s"] / r["tokens"] * 1e3
        groups: dict[str, float] = {}
        for o in r["ops"]:
            groups[_group(o["op"])] = groups.get(_group(o["op"]), 0.0) + o["self_us"]
        shown = sum(groups.values())
        rest_ops = r["in_ops_s"] * 1e6 - shown
        lines = [f"### {model}, {engine}:{quant}" + (f", batch {batch}" if batch > 1 else ""), "",
                 f"- machine: {r['machine'].get('cpu_model')} ({r['machine'].get('isa')}), "
                 f"cores {r['cores']}; {r['engine_version']}",
                 f"- decode: {r['step_ms']:.2f} ms per step of {batch} sequence(s) (tg{r['tokens']}, "
                 f"engine timestamps); profiled wall {wall_ms:.2f} ms per step",
                 f"- command: `{r['command']}`", "",
                 "| where | ms per step | share of profiled wall |", "|---|---:|---:|"]
        for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {g} | {us / 1e3 / r['tokens']:.2f} | {us / 1e6 / r['wall_s'] * 100:.0f}% |")
        if rest_ops > 0:
            lines.append(f"| smaller ops (outside the top {len(r['ops'])}) | "
                         f"{rest_ops / 1e3 / r['tokens']:.2f} | {rest_ops / 1e6 / r['wall_s'] * 100:.0f}% |")
        outside = r["wall_s"] - r["in_ops_s"]
        lines.append(f"| outside any op (Python, vLLM scheduler, sampler) | "
                     f"{outside * 1e3 / r['tokens']:.2f} | {outside / r['wall_s'] * 100:.0f}% |")
        lines += ["", "| top ops | calls per step | self ms per step |", "|---|---:|---:|"]
        for o in r["ops"][:12]:
            lines.append(f"| `{o['op']}` | {o['calls'] / r['tokens']:.1f} | "
                         f"{o['self_us'] / 1e3 / r['tokens']:.3f} |")
        out.append("\n".join(lines))
    return ("# Decode-step profiles\n\nRendered from `profile.jsonl` by `edge-infer bench report`. "
            "Self CPU time on the engine thread under torch's profiler (which adds a little per "
            "op); an op's parallel work counts inside it.\n\n" + "\n\n".join(out) + "\n")
