"""`edge-infer eval humaneval | report` (entry point of edge_infer.commands)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from edge_infer.api import UsageError, require_clean

DEFAULT_RESULTS = Path("docs/results/tasks.jsonl")
DEFAULT_PAGE = Path("docs/analysis/tasks.md")
DEFAULT_BUILDS = "ours:bf16,ours:w4a16-g128-head"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="task-level quality: HumanEval pass@1 of each build, served "
                       "by its engine's OpenAI server, code run in our sandbox")
    esub = p.add_subparsers(dest="eval_command", metavar="ACTION", required=True)

    h = esub.add_parser("humaneval", help="pass@1 and per-problem flips against each engine's "
                        "full-precision build")
    h.add_argument("-m", "--model", action="append", default=[],
                   help="registry model or HF folder; comma list or repeated (default "
                   "qwen2.5-coder-0.5b)")
    h.add_argument("-b", "--build", action="append", default=[],
                   help=f"ENGINE:QUANT builds; comma list (default {DEFAULT_BUILDS}). ours: bf16, "
                   "w4a16|w4a8[-gN][-zp][-head]; llama.cpp: f16, q4_k_m, q4_0")
    h.add_argument("--limit", type=int, default=None, help="first N problems (default all 164)")
    h.add_argument("--max-tokens", type=int, default=512, help="tokens per completion (512)")
    h.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight at once, and the server's slots (1: one stream; "
                   "batched greedy decoding is not bit-identical to it, the record says which)")
    h.add_argument("--server", action="append", default=[], metavar="ENGINE:QUANT=URL",
                   help="score a server already running at URL as that build (no starter)")
    h.add_argument("--timeout", type=float, default=10.0,
                   help="wall-clock seconds per problem in the sandbox (10)")
    h.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs")
    h.add_argument("--lock-wait", type=float, default=0.0,
                   help="seconds to wait for another benchmark's lock before refusing")
    h.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help=f"JSONL the records are appended to (default {DEFAULT_RESULTS})")
    h.add_argument("--no-results", action="store_true", help="print only; write no record")
    h.add_argument("--allow-dirty", action="store_true",
                   help="write records into docs/results from a tree with uncommitted changes")
    h.set_defaults(func=cmd_humaneval)

    rp = esub.add_parser("report", help="render tasks.md from the JSONL, beside fidelity's rows")
    rp.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="tasks JSONL to read")
    rp.add_argument("--fidelity", type=Path, default=None,
                    help="fidelity JSONL to join (default: fidelity.jsonl beside --results)")
    rp.add_argument("--out", type=Path, default=DEFAULT_PAGE, help=f"page (default {DEFAULT_PAGE})")
    rp.add_argument("--command", default="nox -s eval-tasks", help="command named in the page")
    rp.set_defaults(func=cmd_report)


def _list(values: list[str]) -> list[str]:
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def cmd_humaneval(args: argparse.Namespace) -> int:
    from edge_harness.bench.run import parse_engine
    from edge_harness.tasks.run import TasksPlan, label, run
    from edge_harness.tasks.sandbox import Limits

    if args.limit is not None and not 1 <= args.limit <= 164:
        raise UsageError(f"--limit {args.limit}: choose 1..164")
    if args.max_tokens < 1 or args.timeout <= 0 or args.concurrency < 1:
        raise UsageError("--max-tokens, --timeout and --concurrency must be positive")
    builds = [parse_engine(s) for s in _list(args.build or [DEFAULT_BUILDS])]
    attach = {}
    for item in args.server:
        build, eq, url = item.partition("=")
        if not eq or not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {item!r}: expected ENGINE:QUANT=http://HOST:PORT")
        attach[label(parse_engine(build))] = url
    plan = TasksPlan(
        models=_list(args.model) or ["qwen2.5-coder-0.5b"], builds=builds, limit=args.limit,
        max_tokens=args.max_tokens, concurrency=args.concurrency, attach=attach,
        limits=Limits(timeout_s=args.timeout),
        results=require_clean(None if args.no_results else args.results, args.allow_dirty),
        logs=args.logs, lock_wait=args.lock_wait,
        command="edge-infer " + shlex.join(sys.argv[1:]),
    )
    run(plan)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from edge_harness.tasks.render import write

    if not args.results.is_file():
        raise UsageError(f"{args.results}: no such results file (run `edge-infer eval humaneval`)")
    fidelity = args.fidelity or args.results.with_name("fidelity.jsonl")
    if not fidelity.is_file():
        fidelity = None
    print(write(args.results, args.out, fidelity, args.command))
    return 0
