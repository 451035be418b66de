"""The load generator of `bench serve`: vLLM's own serving benchmark client (`vllm bench
serve`), called in a pinned worker (isolation.worker's `call`) so that vLLM is imported once
for every concurrency, and the worker sits idle between measurements for the guard.

`run` takes `vllm bench serve`'s own command-line arguments and returns the figures a record
keeps; the per-request lists come back from vLLM (`--save-detailed` semantics, nothing is
written to disk) and are reduced here.
"""

from __future__ import annotations

from typing import Any

# vLLM's result keys -> ours; percentiles are asked for with --metric-percentiles 50,99
FIGURES = {"output_throughput": "output_tok_s", "request_throughput": "requests_s",
           "total_token_throughput": "total_tok_s", "duration": "duration_s",
           "completed": "completed", "failed": "failed",
           "total_input_tokens": "total_input_tokens",
           "total_output_tokens": "total_output_tokens",
           "max_concurrent_requests": "max_concurrent_requests"}
LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "p50", "p99")


def run(argv: list[str]) -> dict[str, Any]:
    import vllm
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([*argv, "--save-detailed", "--disable-tqdm"])
    result = main(args)
    return {"client": f"vllm bench serve (vllm {vllm.__version__})", **summarize(result)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one `vllm bench serve` result: throughputs, latency percentiles (ms),
    request counts, the lengths actually served, and each distinct error with its count."""
    out: dict[str, Any] = {ours: result.get(theirs) for theirs, ours in FIGURES.items()}
    for metric in LATENCIES:
        out[f"{metric}_ms"] = {s: result.get(f"{s}_{metric}_ms") for s in STATS
                               if result.get(f"{s}_{metric}_ms") is not None}
    errors: dict[str, int] = {}
    for e in result.get("errors") or []:
        if e:
            line = e.strip().splitlines()[-1][:300]  # a traceback's last line says what failed
            errors[line] = errors.get(line, 0) + 1
    out["errors"] = errors
    out["requests"] = len(result.get("errors") or [])
    for name in ("input_lens", "output_lens"):
        lens = [n for n in result.get(name) or [] if n]
        out[name.removesuffix("s")] = {"min": min(lens), "max": max(lens)} if lens else {}
    return out
