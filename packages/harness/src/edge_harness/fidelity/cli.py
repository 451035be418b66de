"""`edge-infer fidelity run | report | crosscheck` (entry point of edge_infer.commands)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from edge_infer.api import UsageError, require_clean

DEFAULT_RESULTS = Path("docs/results/fidelity.jsonl")
DEFAULT_BUILDS = "ours:w4a16,llama.cpp:q4_k_m,llama.cpp:q4_0"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="greedy reproductions, same-top and KL vs each engine's "
                       "own full-precision build (llama-perplexity's statistics)")
    fsub = p.add_subparsers(dest="fidelity_command", metavar="ACTION", required=True)

    r = fsub.add_parser("run", help="score builds against ours:bf16 / llama.cpp:f16")
    r.add_argument("-m", "--model", action="append", default=[],
                   help="registry model or HF folder; comma list or repeated (default smollm2-135m)")
    r.add_argument("-b", "--build", action="append", default=[],
                   help=f"ENGINE:QUANT builds to score; comma list (default {DEFAULT_BUILDS}). "
                   "ours: w4a16[-g32|-g64|-g128][-zp][-head]; llama.cpp: q4_k_m, q4_0, bf16, ...")
    r.add_argument("--corpus", default="lee,shakespeare", help="corpora (lee,shakespeare)")
    r.add_argument("--chunks", type=int, default=8, help="chunks per corpus (8)")
    r.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    r.add_argument("--prompts", type=int, default=12, help="greedy prompts, 0 to skip (12)")
    r.add_argument("--n-gen", type=int, default=32, help="greedy tokens per prompt (32)")
    r.add_argument("--cores", help="CPU ids to pin to (default: all physical cores)")
    r.add_argument("-t", "--threads", type=int, default=None, help="threads (default: one per chosen core)")
    r.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSONL the records are appended to")
    r.add_argument("--no-results", action="store_true", help="print only; write no record")
    r.add_argument("--allow-dirty", action="store_true",
                   help="write records into docs/results from a tree with uncommitted changes")
    r.set_defaults(func=cmd_run)

    rp = fsub.add_parser("report", help="render fidelity.md from the JSONL")
    rp.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="fidelity JSONL to read")
    rp.add_argument("--out", type=Path, default=None, help="default: fidelity.md beside --results")
    rp.add_argument("--command", default="nox -s fidelity", help="command named in the page")
    rp.set_defaults(func=cmd_report)

    x = fsub.add_parser("crosscheck", help="our llama.cpp numbers against llama-perplexity "
                        "--kl-divergence on the same text and GGUFs")
    x.add_argument("-m", "--model", default="smollm2-135m", help="model (see `models list`)")
    x.add_argument("-b", "--build", default="q4_0", help="llama.cpp quant to score (q4_0)")
    x.add_argument("--corpus", default="lee", help="corpus (lee, shakespeare)")
    x.add_argument("--chunks", type=int, default=4, help="chunks of the corpus (4)")
    x.add_argument("--ctx", type=int, default=512, help="tokens per chunk (512)")
    x.add_argument("--tolerance", type=float, default=0.01,
                   help="relative agreement required for mean KL and same top (0.01)")
    x.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSONL the record is appended to")
    x.add_argument("--no-results", action="store_true", help="print only; write no record")
    x.add_argument("--allow-dirty", action="store_true",
                   help="write records into docs/results from a tree with uncommitted changes")
    x.set_defaults(func=cmd_crosscheck)


def _list(values: list[str]) -> list[str]:
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def cmd_run(args: argparse.Namespace) -> int:
    from edge_harness.bench.run import parse_engine
    from edge_harness.fidelity.run import FidelityPlan, FidelityRun

    for name, v in (("--chunks", args.chunks), ("--n-gen", args.n_gen)):
        if v < 1:
            raise UsageError(f"{name} must be at least 1")
    if args.prompts < 0:
        raise UsageError("--prompts must be >= 0")
    plan = FidelityPlan(
        models=_list(args.model) or ["smollm2-135m"],
        builds=[parse_engine(s) for s in _list(args.build or [DEFAULT_BUILDS])],
        corpora=_list([args.corpus]), chunks=args.chunks, n_ctx=args.ctx,
        prompts=args.prompts, n_gen=args.n_gen, cores=args.cores, threads=args.threads,
        results=require_clean(None if args.no_results else args.results, args.allow_dirty),
        command="edge-infer " + shlex.join(sys.argv[1:]),
    )
    FidelityRun(plan).run()
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from edge_harness.fidelity.render import write

    if not args.results.is_file():
        raise UsageError(f"{args.results}: no such results file (run `edge-infer fidelity run`)")
    out = write(args.results, args.out or args.results.with_suffix(".md"), args.command)
    print(out)
    return 0


def cmd_crosscheck(args: argparse.Namespace) -> int:
    from edge_harness.fidelity.perplexity_tool import crosscheck

    ok = crosscheck(args.model, args.build, args.corpus, args.chunks, args.ctx, args.tolerance,
                    require_clean(None if args.no_results else args.results, args.allow_dirty))
    return 0 if ok else 1
