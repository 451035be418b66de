"""`edge-infer bench run`: the benchmark loop, with llama-bench's semantics and our isolation.

For each thread count and model:
1. every engine build is prepared from the model's one HF folder (cached);
2. each build gets its own child process, pinned to the same physical cores before the engine
   loads; the planned setups, then the setups each child reports after loading, must agree in
   cores, threads and prefix caching (else: refused);
3. per test (pp<N>, tg<N>): one warm-up run per engine, then `-r` repetitions interleaved
   A B A B ... so that a machine drifting during the run moves every engine's numbers alike;
4. before every timed repetition the contention guard samples the cores (must be idle), and
   it watches them during the repetition (foreign load must stay low);
5. one record per (build, test) is appended to the results file as soon as its repetitions are
   done.
Children of other engines stay loaded but idle (blocked reading their stdin) while one engine
is timed: the guard's before-check would see them if they were not idle. Only one benchmark
runs on the machine at a time (a file lock), and only one engine is ever timed at a time.
`--schedule sequential` instead loads, measures and tears down one engine after another.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge_harness.bench import ceiling as ceiling_mod
from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.isolation.compare import check_comparable
from edge_harness.record import Record, append_record, read_records
from edge_harness.runners import get_runner, locate
from edge_harness.runners.base import Build, ModelRef
from edge_infer.api import Guard, UsageError, choose_cores, fingerprint, git_state

OPTION_TYPES = {"threads": int, "prefix_caching": bool, "kv_cache_gib": int, "act_dtype": str,
                "compiled": bool, "fused": bool}


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    quant: str
    options: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.engine}:{self.quant}" + (f"@{opts}" if opts else "")


def parse_engine(spec: str) -> EngineSpec:
    """'ENGINE:QUANT[@key=value,...]', e.g. 'ours:w4a16', 'llama.cpp:q4_k_m@threads=1'."""
    head, _, opts = spec.partition("@")
    engine, sep, quant = head.rpartition(":")
    if not sep or not engine or not quant:
        raise UsageError(f"-e {spec!r}: expected ENGINE:QUANT, e.g. ours:w4a16, llama.cpp:q4_k_m")
    runner = get_runner(engine)
    if not runner.accepts(quant):
        raise UsageError(f"-e {spec!r}: {engine} offers {', '.join(runner.quants)}")
    options = []
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTION_TYPES:
            raise UsageError(f"-e {spec!r}: option {item!r}; known: {sorted(OPTION_TYPES)}")
        if OPTION_TYPES[key] is bool:
            parsed = value.lower() in ("1", "true", "on", "yes")
        else:
            parsed = OPTION_TYPES[key](value)
        options.append((key, parsed))
    return EngineSpec(engine, quant, tuple(options))


def resolve_model(name: str) -> ModelRef:
    from edge_infer.api import REGISTRY, model_path

    if name in REGISTRY:
        m = model_path(name)
        return ModelRef(name, m.hf_dir, m.gguf_path)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return ModelRef(path.name, path.resolve())
    raise UsageError(f"model {name!r}: not a known model ({', '.join(sorted(REGISTRY))}) and "
                     "not a HF folder")


@dataclass(kw_only=True)
class Isolation:
    """Where records go and how a measurement is guarded: shared by every guarded command
    (bench run, crosscheck, ceiling, gemm)."""

    results: Path | None = Path("docs/results/bench.jsonl")
    force: bool = False
    threshold: float = 0.15
    window: float = 1.0
    wait: float = 0.0
    lock_wait: float = 0.0
    command: str = ""


@dataclass
class Plan(Isolation):
    models: list[str]
    engines: list[EngineSpec]
    n_prompt: list[int] = field(default_factory=lambda: [512])
    n_gen: list[int] = field(default_factory=lambda: [128])
    reps: int = 5
    threads: list[int | None] = field(default_factory=lambda: [None])
    cores: str | None = None
    schedule: str = "interleaved"
    seed: int = 0
    ceiling: bool = True

    @property
    def tests(self) -> list[tuple[str, int]]:
        return ([("pp", p) for p in self.n_prompt if p > 0]
                + [("tg", n) for n in self.n_gen if n > 0])


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        say(f"[{self.done}/{self.total} {_mmss(elapsed)} eta {_mmss(eta)}] {text}")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _mmss(s: float) -> str:
    return f"{int(s // 60)}:{int(s % 60):02d}"


class Bench:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.cpu = fingerprint()
        self.commit, self.dirty = git_state()
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{id(self) % 10000:04d}"
        self.records: list[Record] = []

    # -- records -------------------------------------------------------------------------
    def emit(self, record: Record) -> None:
        self.records.append(record)
        if self.plan.results is not None:
            append_record(self.plan.results, record)

    def record(self, **kw) -> Record:
        return Record(
            cpu_model=self.cpu["cpu_model"], cpu_id=self.cpu["cpu_id"], isa=self.cpu["isa"],
            cpu_flags=self.cpu["cpu_flags"],
            run_id=self.run_id, git_commit=self.commit, git_dirty=self.dirty,
            command=self.plan.command, **kw,
        )

    # -- the run -------------------------------------------------------------------------
    def run(self) -> list[Record]:
        p = self.plan
        if not p.tests:
            raise UsageError("nothing to measure: -p and -n are both 0")
        thread_sets = [(t, choose_cores(p.cores, t)) for t in p.threads]
        for _, cores in thread_sets:  # refuse a misconfigured comparison before anything runs
            check_comparable(self.planned(cores))
        models = [resolve_model(m) for m in p.models]
        with bench_lock(p.lock_wait):
            widest = max((c for _, c in thread_sets), key=len)
            guard = Guard(widest, p.threshold, p.window, p.force, p.wait)
            status, reading = guard.check_idle("the benchmark")
            say(f"guard: cores {widest} idle check {status} ({reading.describe()})")
            builds = self.prepare(models)
            for _, cores in thread_sets:
                threads = len(cores)
                guard = Guard(cores, p.threshold, p.window, p.force, p.wait)
                ceiling = self.ceiling(guard) if p.ceiling else self.last_ceiling(cores)
                for model in models:
                    self.measure_model(model, builds[model.name], cores, threads, guard, ceiling)
        return self.records

    def planned(self, cores: list[int]) -> dict[str, dict]:
        """What each engine will run with, from the plan (per-engine options included)."""
        opts = {e.label: dict(e.options) for e in self.plan.engines}
        return {label: {"cores": cores, "threads": o.get("threads", len(cores)),
                        "prefix_caching": o.get("prefix_caching", False)}
                for label, o in opts.items()}

    def prepare(self, models: list[ModelRef]) -> dict[str, list[Build]]:
        out: dict[str, list[Build]] = {}
        for model in models:
            out[model.name] = []
            for spec in self.plan.engines:
                say(f"prepare {model.name} {spec.label}")
                build = get_runner(spec.engine).prepare(model, spec.quant)
                out[model.name].append(Build(**{**build.to_dict(),
                                                "options": dict(spec.options)}))
        return out

    def ceiling(self, guard: Guard) -> float:
        say(f"ceiling: streaming read on cores {guard.cores} (1 GiB per core)")
        res, verdict = ceiling_mod.measure_guarded(guard)
        rec = self.record(engine="numpy", engine_version=_numpy_version(), model="-",
                          quant="-", test="ceiling", samples=res["samples_gbs"], unit="GB/s",
                          threads=len(guard.cores), cores=guard.cores, **verdict.fields(),
                          extra={k: v for k, v in res.items() if k != "samples_gbs"})
        self.emit(rec)
        say(f"ceiling: {res['ceiling_gbs']:.1f} GB/s best of {len(res['samples_gbs'])} passes")
        return res["ceiling_gbs"]

    def last_ceiling(self, cores: list[int]) -> float | None:
        path = self.plan.results
        if path is None or not path.is_file():
            return None
        found = [r for r in read_records(path) if r.test == "ceiling" and r.cores == cores]
        return max(found[-1].samples) if found else None

    # -- one model: all builds, all tests -------------------------------------------------
    def measure_model(self, model: ModelRef, builds: list[Build], cores: list[int],
                      threads: int, guard: Guard, ceiling: float | None) -> None:
        p = self.plan
        n_ctx = max([n for _, n in p.tests] + [max(p.n_gen, default=0) + 1])
        progress = Progress(len(builds) * len(p.tests) * p.reps)
        groups = [builds] if p.schedule == "interleaved" else [[b] for b in builds]
        reported: dict[str, dict] = {}
        for group in groups:
            workers = []
            try:
                for b in group:
                    say(f"load {model.name} {b.label} on cores {cores} ({threads} threads)")
                    runner = get_runner(b.engine)
                    t = b.options.get("threads", threads)  # an override is refused in a pair
                    w = Worker(cores, runner.child_env(cores, t, b.options),
                               label=f"{model.name}-{b.label}")
                    workers.append(w)
                    facts = w.request("load", engine=locate(runner), build=b.to_dict(),
                                      threads=t, n_ctx=n_ctx)["facts"]
                    reported[b.label] = facts
                    check_comparable(reported)
                for test, n in p.tests:
                    self.measure_test(model, list(zip(group, workers, strict=True)), test, n,
                                      cores, threads, guard, ceiling, reported, progress)
            finally:
                for w in workers:
                    w.close()

    def measure_test(self, model, pairs, test, n, cores, threads, guard, ceiling, reported,
                     progress) -> None:
        p = self.plan
        name = f"{test}{n}"
        for b, w in pairs:  # one warm-up per engine, untimed
            say(f"warm-up {model.name} {b.label} {name}")
            w.request(test, n=n, seed=p.seed * 1000 + 999)
        samples = {b.label: [] for b, _ in pairs}
        seconds = {b.label: [] for b, _ in pairs}
        walls = {b.label: [] for b, _ in pairs}
        per_rep = {b.label: [] for b, _ in pairs}  # what a runner reports of each repetition
        verdicts = {b.label: guard.verdict() for b, _ in pairs}
        for rep in range(p.reps):
            for b, w in pairs:  # A B A B: every engine once per round
                what = f"{name} of {model.name} {b.label} (repetition {rep + 1})"
                reply = guard.measure(w.pid, what, verdicts[b.label], w.request, test, n=n,
                                      seed=p.seed * 1000 + rep, say=say)
                secs = reply["seconds"]
                seconds[b.label].append(secs)
                samples[b.label].append(n / secs)
                if reply.get("wall") is not None:
                    walls[b.label].append(reply["wall"])
                if reply.get("extra") is not None:
                    per_rep[b.label].append(reply["extra"])
                flag = "" if verdicts[b.label].status == "ok" else " [guard overridden]"
                progress.step(f"{model.name} {b.label} {name} rep {rep + 1}/{p.reps}: "
                              f"{n / secs:.2f} tok/s{flag}")
        for b, _ in pairs:
            label = b.label
            rec = self.record(
                engine=b.engine, engine_version=reported[label]["version"], model=model.name,
                quant=b.quant, test=name, samples=samples[label], unit="tok/s",
                bits_per_weight=round(b.bits_per_weight, 4),
                n_prompt=n if test == "pp" else 0, n_gen=n if test == "tg" else 0,
                threads=threads, cores=cores, **verdicts[label].fields(),
                weight_bytes_per_token=b.weight_bytes_per_token,
                extra={"seconds": seconds[label], "facts": reported[label],
                       "schedule": p.schedule, "options": b.options,
                       **({"wall_seconds": walls[label]} if walls[label] else {}),
                       **({"repetitions": per_rep[label]} if per_rep[label] else {})},
            )
            if test == "tg":
                rec.achieved_gbs = round(b.weight_bytes_per_token * rec.median / 1e9, 3)
                if ceiling:
                    rec.against_ceiling(ceiling)
            self.emit(rec)


def _numpy_version() -> str:
    import numpy

    return f"numpy {numpy.__version__}"


def command_line() -> str:
    return "edge-infer " + shlex.join(sys.argv[1:])
