"""`edge-infer bench run | crosscheck | load | ceiling | gemm | batched | report | fleet | merge`
(entry point of edge_infer.commands).

Flags of `bench run` follow llama-bench: -m, -p, -n, -r, -t (comma lists), -o md|csv|json|
jsonl|sql; engines are ENGINE:QUANT specs (`-e ours:w4a16,llama.cpp:q4_k_m`).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from edge_infer.api import UsageError, require_clean

DEFAULT_RESULTS = Path("docs/results/bench.jsonl")
DEFAULT_ENGINES = "ours:w4a16,llama.cpp:q4_k_m"



def _fraction(text: str) -> float:
    """A guard threshold: a fraction of one core in (0, 1] (above 1 every run would pass)."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: choose a fraction of one core in (0, 1]")
    return value

def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _range(text: str) -> tuple[int, int]:
    """'LO:HI' (or one number N for N:N) as a pair of integers."""
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI token counts, got {text!r}") from None


def _seconds(text: str, *, zero_ok: bool) -> float:
    """A number of seconds, > 0 (or >= 0 with zero_ok); a bad value is argparse's one-line error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 0 if zero_ok else value > 0):
        bound = "0 or more" if zero_ok else "greater than 0"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return value


def _positive(text: str) -> float:
    return _seconds(text, zero_ok=False)


def _nonnegative(text: str) -> float:
    return _seconds(text, zero_ok=True)


def _list(values: list[str]) -> list[str]:
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def split_engines(values: list[str]) -> list[str]:
    """Comma lists of ENGINE:QUANT[@k=v,k=v]: a piece without ':' is an option of the last."""
    out: list[str] = []
    for v in values:
        for piece in v.split(","):
            piece = piece.strip()
            if not piece:
                continue
            if ":" not in piece and out and "@" in out[-1]:
                out[-1] += "," + piece
            else:
                out.append(piece)
    return out


def _guard_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("isolation")
    g.add_argument("--cores", help="CPU ids to pin to, one per physical core (default: all "
                   "physical cores this process may use)")
    g.add_argument("--force", action="store_true", help="run even when the contention guard "
                   "sees foreign load; records say guard: overridden")
    g.add_argument("--threshold", type=_fraction, default=0.15,
                   help="foreign load allowed per core, fraction of one core (default 0.15)")
    g.add_argument("--window", type=_positive, default=1.0,
                   help="seconds the guard samples before each measurement (default 1)")
    g.add_argument("--wait", type=_nonnegative, default=0.0,
                   help="seconds to wait for busy cores to become idle before refusing")
    g.add_argument("--lock-wait", type=_nonnegative, default=0.0,
                   help="seconds to wait for another benchmark's lock before refusing")


def _dirty_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-dirty", action="store_true",
                   help="write records into docs/results from a tree with uncommitted changes "
                   "(refused otherwise; the records say git_dirty)")


def _out(args: argparse.Namespace) -> Path | None:
    """The results file the command appends to, or None; a dirty tree may not publish."""
    return require_clean(None if args.no_results else args.results, args.allow_dirty)


def _results_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help=f"JSONL file records are appended to (default {DEFAULT_RESULTS})")
    p.add_argument("--no-results", action="store_true", help="append no records")
    _dirty_flag(p)
    p.add_argument("-o", "--output", choices=("md", "csv", "json", "jsonl", "sql"),
                   default="md", help="format of the results printed at the end (default md)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="isolated llama-bench-style benchmarks against llama.cpp")
    bsub = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)

    r = bsub.add_parser("run", help="pp/tg of engine builds, pinned, guarded, interleaved")
    r.add_argument("-m", "--model", action="append", default=[],
                   help="registry model or HF folder; comma list or repeated "
                   "(default smollm2-135m)")
    r.add_argument("-e", "--engine", action="append", default=[],
                   help="ENGINE:QUANT[@threads=N,prefix_caching=on]; comma list or repeated "
                   f"(default {DEFAULT_ENGINES}). Engines: ours (bf16, w4a16), llama.cpp "
                   "(bf16, f16, q4_k_m, q4_0, original), torch (bf16, fp32)")
    r.add_argument("-p", "--n-prompt", type=_ints, default=[512], help="prefill sizes (512)")
    r.add_argument("-n", "--n-gen", type=_ints, default=[128], help="decode lengths (128)")
    r.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions (5)")
    r.add_argument("-t", "--threads", type=_ints, default=None,
                   help="thread counts (default: one per chosen core); each uses the first N "
                   "chosen cores")
    r.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: engines alternate within each repetition (default); "
                   "sequential: all repetitions of one engine, then the next")
    r.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    r.add_argument("--no-ceiling", action="store_true",
                   help="skip the streaming-read ceiling (reuse the newest one in --results)")
    _results_flags(r)
    _guard_flags(r)
    r.set_defaults(func=cmd_run)

    x = bsub.add_parser("crosscheck", help="the real llama-bench beside our llama.cpp runner, "
                        "same GGUF, cores and guard, alternating; recorded")
    x.add_argument("-m", "--model", default="smollm2-135m", help="registry model or HF folder")
    x.add_argument("-q", "--quant", default="q4_k_m",
                   help="llama.cpp quant of the GGUF both run (bf16, f16, q4_k_m, q4_0, original)")
    x.add_argument("-p", "--n-prompt", type=int, default=512, help="prefill size (512)")
    x.add_argument("-n", "--n-gen", type=int, default=128, help="decode length (128)")
    x.add_argument("-r", "--repetitions", type=int, default=3,
                   help="rounds; each runs llama-bench -r 1 once and our runner once (3)")
    x.add_argument("-t", "--threads", type=int, default=None,
                   help="threads (default: one per chosen core)")
    x.add_argument("--seed", type=int, default=0, help="seed of our runner's random token ids")
    x.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help=f"JSONL file records are appended to (default {DEFAULT_RESULTS})")
    x.add_argument("--no-results", action="store_true", help="append no records")
    _dirty_flag(x)
    _guard_flags(x)
    x.set_defaults(func=cmd_crosscheck)

    ld = bsub.add_parser("load", help="load generator: busy processes on cores, bounded in time")
    ld.add_argument("--cores", required=True, help="CPU ids to load, e.g. 0,1")
    ld.add_argument("--seconds", type=_positive, required=True, help="how long (it stops by itself)")
    ld.set_defaults(func=cmd_load)

    c = bsub.add_parser("ceiling", help="streaming-read bandwidth ceiling on the chosen cores")
    c.add_argument("-t", "--threads", type=int, default=None, help="threads (default: one per chosen core)")
    c.add_argument("--gib", type=float, default=1.0, help="GiB read per core (default 1)")
    c.add_argument("--passes", type=int, default=5, help="passes; the ceiling is the best (default 5)")
    _results_flags(c)
    _guard_flags(c)
    c.set_defaults(func=cmd_ceiling)

    g = bsub.add_parser("gemm", help="our 4-bit kernels vs bf16/fp32 F.linear, model shapes")
    g.add_argument("-m", "--model", action="append", default=[],
                   help="models whose linear shapes to use (default smollm2-135m)")
    g.add_argument("-t", "--threads", type=int, default=None, help="threads (default: one per chosen core)")
    g.add_argument("--m-sizes", type=_ints, default=[1, 512], help="M values (1,512)")
    g.add_argument("--kernels", default=None,
                   help="4-bit kernels, comma-separated, or `dispatched` for the one the engine "
                   "picks per shape and scheme (default: all available)")
    g.add_argument("--min-time", type=float, default=0.3, help="seconds timed per case")
    g.add_argument("--no-ceiling", action="store_true",
                   help="skip the streaming ceiling (by default measured first, and each "
                        "decode-sized record carries its %% of it)")
    _results_flags(g)
    _guard_flags(g)
    g.set_defaults(func=cmd_gemm)

    pf = bsub.add_parser("profile", help="per-op split of our engine's decode step (torch profiler)")
    pf.add_argument("-m", "--model", default="qwen3-0.6b-random", help="model (see `models list`)")
    pf.add_argument("-e", "--engine", default="ours:w4a16-head", help="ours:QUANT")
    pf.add_argument("-n", "--n-gen", type=int, default=32, help="decode steps profiled (32)")
    pf.add_argument("-b", "--batch", type=int, default=1,
                    help="sequences decoded together in each step (1; batched decode)")
    pf.add_argument("-t", "--threads", type=int, default=None, help="threads (default: one per chosen core)")
    pf.add_argument("--results", type=Path, default=DEFAULT_RESULTS.with_name("profile.jsonl"),
                    help="JSONL the record is appended to")
    pf.add_argument("--no-results", action="store_true", help="print only; write no record")
    _dirty_flag(pf)
    _guard_flags(pf)
    pf.set_defaults(func=cmd_profile)

    bb = bsub.add_parser("batched", help="decode step time against the sequences decoded "
                         "together: ours and llama-batched-bench, pinned, guarded")
    bb.add_argument("-m", "--model", default="qwen3-0.6b-random", help="model (see `models list`)")
    bb.add_argument("-e", "--engine", action="append", default=[],
                    help="ENGINE:QUANT, comma list (default ours:w4a8-head,llama-bench:q4_k_m)")
    bb.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16],
                    help="sequences decoded together (1,2,4,8,16)")
    bb.add_argument("-n", "--n-gen", type=int, default=32, help="decode steps per repetition (32)")
    bb.add_argument("-r", "--reps", type=int, default=3, help="repetitions per batch size (3)")
    bb.add_argument("-t", "--threads", type=int, default=None, help="threads (default: one per chosen core)")
    _results_flags(bb)
    _guard_flags(bb)
    bb.set_defaults(func=cmd_batched)

    sv = bsub.add_parser("serve", help="our OpenAI server vs llama-server under concurrent load "
                         "(vllm bench serve's client), pinned, guarded, one server at a time")
    sv.add_argument("-m", "--model", default="smollm2-135m", help="registry model or HF folder")
    sv.add_argument("-e", "--engine", action="append", default=[],
                    help="ENGINE:QUANT per server, comma list (default "
                    "ours:w4a16-head,llama.cpp:q4_k_m); ours takes @compiled=1, @fused=0")
    sv.add_argument("-c", "--concurrency", type=_ints, default=[1, 4, 8, 16],
                    help="requests in flight; each server is started with that many slots "
                    "(1,4,8,16)")
    sv.add_argument("--input-len", type=_range, default=(128, 1024),
                    help="prompt tokens, LO:HI, drawn uniformly (128:1024)")
    sv.add_argument("--output-len", type=_range, default=(64, 256),
                    help="output tokens, LO:HI, drawn uniformly, EOS ignored (64:256)")
    sv.add_argument("--rounds", type=int, default=4,
                    help="measured requests = ROUNDS x concurrency, after one warm-up request "
                    "per slot (4)")
    sv.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt starts with; > 0 turns prefix caching on for both "
                    "servers (0: random prompts, caching off)")
    sv.add_argument("-t", "--threads", type=int, default=None,
                    help="threads (default: one per chosen core)")
    sv.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (0)")
    sv.add_argument("--start-timeout", type=_positive, default=900.0,
                    help="seconds a server may take to answer /health (900)")
    sv.add_argument("--results", type=Path, default=DEFAULT_RESULTS.with_name("serve.jsonl"),
                    help="JSONL records are appended to (default docs/results/serve.jsonl)")
    sv.add_argument("--no-results", action="store_true", help="append no records")
    _dirty_flag(sv)
    _guard_flags(sv)
    sv.set_defaults(func=cmd_serve)

    rp = bsub.add_parser("report", help="markdown tables + PNG plots from the results JSONL")
    rp.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="bench JSONL to read")
    rp.add_argument("--out", type=Path, default=None,
                    help="output folder (default: the results file's folder)")
    rp.set_defaults(func=cmd_report)
    _add_fleet(bsub)


def _add_fleet(bsub: argparse._SubParsersAction) -> None:
    from edge_harness.bench.fleet import KINDS

    kinds = ", ".join(f"{k} ({v.help})" for k, v in KINDS.items())
    fl = bsub.add_parser(
        "fleet", help="one bench plan on several CPU kinds: Ray tasks, or Kubernetes Jobs",
        description="Run `edge-infer bench ACTION ARGS` once per --kind, as Ray tasks on an "
        "existing Ray cluster (each node started with the resource cpu-kind-KIND), or write the "
        "same plan as Kubernetes Jobs with node-feature-discovery labels (--kubernetes). Example: "
        "edge-infer bench fleet --kind avx2 --kind amx --out fleet/ -- run -m smollm2-135m")
    fl.add_argument("--kind", action="append", default=[],
                    help=f"a CPU kind to measure, repeated. Jobs know: {kinds}")
    fl.add_argument("--out", type=Path, help="folder for KIND.jsonl records (Ray) or the Job "
                    "manifests (--kubernetes)")
    fl.add_argument("--address", help="Ray cluster (default RAY_ADDRESS, else the local one)")
    fl.add_argument("--timeout", type=_positive, default=None,
                    help="seconds to wait for each task's answer (default: no limit)")
    fl.add_argument("--kubernetes", action="store_true",
                    help="write Job manifests to --out instead of submitting to Ray")
    fl.add_argument("--image", default="edge-infer-harness:latest",
                    help="the harness image the Jobs run (default edge-infer-harness:latest)")
    fl.add_argument("--cpus", type=int, default=2,
                    help="whole cores each Job requests and is limited to (default 2)")
    fl.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="-- ACTION ARGS",
                    help="the bench action each task runs: run, ceiling or gemm, with its flags")
    fl.set_defaults(func=cmd_fleet)

    mg = bsub.add_parser("merge", help="records of many machines in one table, rows by CPU "
                         "fingerprint, ratios only within a machine")
    mg.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                    help="JSONL record files, or folders of them (e.g. bench fleet's --out)")
    mg.add_argument("--baseline", default="llama.cpp:q4_k_m",
                    help="ENGINE:QUANT the ratios are taken against, on the same machine "
                    "(default llama.cpp:q4_k_m; '' for none)")
    mg.add_argument("-o", "--output", choices=("md", "csv"), default="md", help="format (md)")
    mg.set_defaults(func=cmd_merge)


def _print_records(records, fmt: str) -> None:
    from edge_harness.report.printers import PRINTERS

    sys.stdout.write(PRINTERS[fmt](records))
    sys.stdout.flush()


def cmd_run(args: argparse.Namespace) -> int:
    from edge_harness.bench.run import Bench, Plan, command_line, parse_engine

    if args.repetitions < 1:
        raise UsageError("-r must be at least 1")
    plan = Plan(
        models=_list(args.model) or ["smollm2-135m"],
        engines=[parse_engine(s) for s in split_engines(args.engine or [DEFAULT_ENGINES])],
        n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.repetitions,
        threads=args.threads or [None], cores=args.cores, schedule=args.schedule,
        seed=args.seed, ceiling=not args.no_ceiling,
        results=_out(args),
        force=args.force, threshold=args.threshold, window=args.window, wait=args.wait,
        lock_wait=args.lock_wait, command=command_line(),
    )
    labels = [e.label for e in plan.engines]
    if len(set(labels)) != len(labels):
        raise UsageError(f"-e lists an engine build twice: {labels}")
    records = Bench(plan).run()
    _print_records([r for r in records if r.test != "ceiling"], args.output)
    return 0


def cmd_crosscheck(args: argparse.Namespace) -> int:
    from edge_harness.bench.crosscheck import CrosscheckPlan, crosscheck, table
    from edge_harness.bench.run import command_line
    from edge_harness.runners.llamacpp import LlamaCppRunner

    if args.quant not in LlamaCppRunner.quants:
        raise UsageError(f"-q {args.quant}: llama.cpp offers {', '.join(LlamaCppRunner.quants)}")
    plan = CrosscheckPlan(
        model=args.model, quant=args.quant, n_prompt=args.n_prompt, n_gen=args.n_gen,
        reps=args.repetitions, threads=args.threads, cores=args.cores, seed=args.seed,
        results=_out(args), force=args.force,
        threshold=args.threshold, window=args.window, wait=args.wait, lock_wait=args.lock_wait,
        command=command_line(),
    )
    records = crosscheck(plan)
    first = records[0].extra
    print(f"llama-bench {first['build_commit']} (build {first['build_number']}) beside our "
          f"llama.cpp runner ({first['ours_version']}) on {first['gguf']}:\n")
    sys.stdout.write(table(records))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from edge_harness.isolation import load
    from edge_infer.api import parse_cpu_list

    try:
        cores = parse_cpu_list(args.cores)
    except ValueError:
        raise UsageError(f"--cores {args.cores!r}: expected CPU ids like 0,1 or 0-3") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not set(cores) <= allowed:
        raise UsageError(f"--cores {args.cores}: choose among {sorted(allowed)}")
    return load.run(cores, args.seconds)


@contextmanager
def _guarded(args: argparse.Namespace):
    """(Bench, cores, Guard) for a measurement that is not `bench run`, under the bench lock."""
    from edge_harness.bench.run import Bench, Plan, command_line
    from edge_harness.isolation.child import bench_lock
    from edge_infer.api import Guard, choose_cores

    cores = choose_cores(args.cores, args.threads)
    bench = Bench(Plan(models=[], engines=[], results=_out(args), command=command_line()))
    with bench_lock(args.lock_wait):
        yield bench, cores, Guard(cores, args.threshold, args.window, args.force, args.wait)


def cmd_ceiling(args: argparse.Namespace) -> int:
    from edge_harness.bench import ceiling

    with _guarded(args) as (bench, cores, guard):
        res, verdict = ceiling.measure_guarded(guard, args.gib, args.passes)
    rec = bench.record(engine="numpy", engine_version=_numpy_version(), model="-", quant="-",
                       test="ceiling", samples=res["samples_gbs"], unit="GB/s",
                       threads=len(cores), cores=cores, **verdict.fields(),
                       extra={k: v for k, v in res.items() if k != "samples_gbs"})
    bench.emit(rec)
    _print_records([rec], args.output)
    print(f"ceiling: {res['ceiling_gbs']:.2f} GB/s on cores {cores}", file=sys.stderr)
    return 0


def _numpy_version() -> str:
    import numpy

    return f"numpy {numpy.__version__}"


def cmd_gemm(args: argparse.Namespace) -> int:
    from edge_harness.bench import gemm
    from edge_harness.bench.run import say

    with _guarded(args) as (bench, cores, guard):
        gemm.run(_list(args.model) or ["smollm2-135m"], cores, guard=guard, emit=bench.emit,
                 record=bench.record, min_time=args.min_time, ms=args.m_sizes,
                 kernels=_list([args.kernels]) if args.kernels else None,
                 ceiling=None if args.no_ceiling else bench.ceiling, say=say)
    _print_gemm(bench.records, args.output)
    return 0


def _print_gemm(records, fmt: str) -> None:
    if fmt != "md":
        _print_records(records, fmt)
        return
    from edge_harness.report.printers import GEMM_COLUMNS, gemm_row, is_gemm, md_table

    sys.stdout.write(md_table(GEMM_COLUMNS, [gemm_row(r) for r in records if is_gemm(r)]))


def cmd_batched(args: argparse.Namespace) -> int:
    from edge_harness.bench import batched
    from edge_harness.bench.run import parse_engine, say

    specs = [parse_engine(e) for e in _list(args.engine) or ["ours:w4a8-head", "llama-bench:q4_k_m"]]
    with _guarded(args) as (bench, cores, guard):
        batched.run(args.model, specs, args.batches, args.n_gen, args.reps, cores, guard=guard,
                    emit=bench.emit, record=bench.record, say=say)
    _print_records(bench.records, args.output)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from edge_harness.bench import profile
    from edge_harness.bench.run import command_line, parse_engine, say

    spec = parse_engine(args.engine)  # ENGINE:QUANT[@key=value,...], as bench run's -e
    profile.run(args.model, spec.engine, spec.quant, args.n_gen, args.cores, args.threads,
                _out(args), command_line(), args.lock_wait, say=say,
                options=dict(spec.options), batch=args.batch,
                guard={"threshold": args.threshold, "window": args.window, "force": args.force,
                       "wait": args.wait})
    if not args.no_results:
        sys.stdout.write(profile.render(args.results))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from edge_harness.bench import serve
    from edge_harness.bench.run import command_line, parse_engine
    from edge_harness.report.serve import table

    plan = serve.ServePlan(
        model=args.model,
        engines=[parse_engine(s) for s in split_engines(args.engine or [serve.DEFAULT_ENGINES])],
        concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
        rounds=args.rounds, shared_prefix=args.shared_prefix, threads=args.threads,
        cores=args.cores, seed=args.seed, start_timeout=args.start_timeout,
        results=_out(args), force=args.force, threshold=args.threshold, window=args.window,
        wait=args.wait, lock_wait=args.lock_wait, command=command_line())
    records = serve.run(plan)
    sys.stdout.write(table(records))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from edge_harness.report.render import render

    if not args.results.is_file():
        raise UsageError(f"no results at {args.results}; run `edge-infer bench run` first")
    out = args.out or args.results.parent
    table = render(args.results, out)
    prof = args.results.with_name("profile.jsonl")
    if prof.is_file():
        from edge_harness.bench.profile import render as render_profile

        (out / "profile.md").write_text(render_profile(prof))
    served = args.results.with_name("serve.jsonl")
    if served.is_file():
        from edge_harness.report.serve import render as render_serve

        render_serve(served, out)
    print(f"wrote {out / 'report.md'} and plots", file=sys.stderr)
    sys.stdout.write("\nOurs / llama.cpp (median tok/s; ratio > 1: ours faster):\n\n" + table)
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from edge_harness.bench import fleet, merge
    from edge_harness.bench.run import command_line, say

    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.out is None:
        raise UsageError("bench fleet: --out FOLDER is required (records, or Job manifests)")
    if args.kubernetes:
        paths = fleet.write_jobs(args.kind, bench_args, args.out, args.image, args.cpus,
                                 command_line())
        say(f"wrote {len(paths)} Job(s) to {args.out}: `kubectl apply -k {args.out}`, then "
            "`kubectl logs job/edge-infer-bench-KIND -c records > KIND.jsonl` per kind")
        return 0
    outcomes = fleet.submit(args.kind, bench_args, args.out, args.address, args.timeout, say=say)
    answered = [o for o in outcomes if o["ok"] and o["records"]]
    if answered:
        sys.stdout.write(merge.markdown(merge.collect([args.out]), None))
    failed = [o["kind"] for o in outcomes if not o["ok"]]
    if failed:
        say(f"bench fleet: {len(failed)} of {len(outcomes)} kind(s) failed: {', '.join(failed)}")
        return 1
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from edge_harness.bench import merge

    records = merge.collect(args.paths)
    baseline = args.baseline or None
    sys.stdout.write(merge.markdown(records, baseline) if args.output == "md"
                     else merge.to_csv(records, baseline))
    return 0
