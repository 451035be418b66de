"""Serve smoke measurements, appended to docs/results/engine.jsonl (run by `nox -s serve-smoke`).

1. greedy: the 12 fixed chat prompts, greedy, on the default model's bf16 build and on its
   W4A16 build: exact matches and first divergence (recorded, not asserted), kernel used.
2. cold start: `edge-infer serve` started from nothing N times; time from spawn to the first
   streamed token of a completion, then decode tok/s of that stream (tokens after the first
   over the time after the first). Medians over the repetitions. Each start is timed under the
   contention guard (edge_infer.guard), on the cores this process may use, and the record
   carries its verdict: a start beside foreign load is taken again, then refused.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from edge_infer import profiles
from edge_infer.errors import EdgeInferError
from edge_infer.guard import DEFAULT_THRESHOLD, Guard
from edge_infer.models.pull import pull
from edge_infer.models.registry import DEFAULT_MODEL
from edge_infer.prompts import GREEDY_PROMPTS, first_divergence
from edge_infer.results import append, command_line, context, require_clean
from edge_infer.serve import process
from edge_infer.serve.resolve import Resolved, default_build
from edge_infer.serve.runtime import vllm_env


def greedy_outputs(r: Resolved, max_tokens: int) -> tuple[list[list[int]], list[str]]:
    from vllm import SamplingParams

    from edge_infer.serve.offline import make_llm

    llm = make_llm(r, prefix_caching=False)
    kernels = sorted({k for d in llm.apply_model(_kernels) for k in d})
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    convs = [[{"role": "user", "content": p}] for p in GREEDY_PROMPTS]
    outs = llm.chat(convs, params, use_tqdm=False)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], kernels


def _kernels(model) -> set[str]:
    return {m.w4_kernel.name for m in model.modules() if hasattr(m, "w4_kernel")}


def run_greedy(out: Path, max_tokens: int, guard: Guard) -> dict:
    prof = profiles.load(DEFAULT_MODEL)
    os.environ.update(vllm_env(prof))
    provenance = context(threads=len(guard.cores))
    bf16 = Resolved(pull(DEFAULT_MODEL).hf_dir, DEFAULT_MODEL, prof)
    w4 = Resolved(default_build(DEFAULT_MODEL, prof), f"{DEFAULT_MODEL}-w4a16", prof)
    with guard.observe("greedy W4A16 against bf16") as verdict:  # not a timing: observed
        ref, _ = greedy_outputs(bf16, max_tokens)
        got, kernels = greedy_outputs(w4, max_tokens)
    div = [first_divergence(a, b) for a, b in zip(ref, got, strict=True)]
    rec = {
        **provenance,
        **verdict.fields(),
        "cores": guard.cores,
        "command": command_line(),
        "kind": "greedy_vs_bf16",
        "model": DEFAULT_MODEL,
        "quant": f"w4a16-g{prof.quant.group_size}",
        "kernels": kernels,
        "prompts": len(GREEDY_PROMPTS),
        "new_tokens": max_tokens,
        "exact_matches": sum(d is None for d in div),
        "first_divergence": div,
    }
    append(out, rec)
    return rec


def one_cold_start(extra: list[str], tokens: int, timeout: float) -> tuple[float, float]:
    start = time.monotonic()
    proc, base = process.spawn(extra)
    try:
        url = f"{base}/v1/completions"
        body = json.dumps({
            "model": f"{DEFAULT_MODEL}-w4a16", "prompt": "Once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
        }).encode()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"edge-infer serve exited with {proc.returncode}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"no first token after {timeout:.0f} s")
            try:
                req = urllib.request.Request(url, data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    stamps = [time.monotonic() for line in resp if line.startswith(b"data: {")]
                break
            except OSError:
                time.sleep(0.25)
        first = stamps[0] - start
        tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
        return first, tok_s
    finally:
        process.stop(proc)


def run_cold_start(out: Path, reps: int, tokens: int, mode: str, timeout: float,
                   guard: Guard) -> dict:
    prof = profiles.load(DEFAULT_MODEL)
    default_build(DEFAULT_MODEL, prof)  # built before timing: cold start = process start only
    extra = [] if mode == "eager" else ["--profile", str(_compiled_profile())]
    provenance = context(threads=len(guard.cores))  # the code that runs, now
    verdict = guard.verdict()
    firsts, rates = [], []
    for i in range(reps):
        # the server is our child: the watch counts its CPU time as ours, not foreign
        first, rate = guard.measure(
            os.getpid(), f"serve cold start {mode} {i + 1}/{reps}", verdict, one_cold_start,
            extra, tokens, timeout, say=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"cold start {mode} {i + 1}/{reps}: first token {first:.1f} s, "
              f"decode {rate:.2f} tok/s", file=sys.stderr, flush=True)
        firsts.append(first)
        rates.append(rate)
    rec = {
        **provenance,
        **verdict.fields(),
        "cores": guard.cores,
        "command": command_line(),
        "kind": "serve_cold_start",
        "model": DEFAULT_MODEL,
        "quant": f"w4a16-g{prof.quant.group_size}",
        "mode": mode,
        "repetitions": reps,
        "decode_tokens": tokens,
        "first_token_s": {"median": statistics.median(firsts), "samples": firsts},
        "decode_tok_s": {"median": statistics.median(rates), "samples": rates},
    }
    append(out, rec)
    return rec


def _compiled_profile() -> Path:
    """The default profile with torch.compile on (enforce_eager off), as a temporary file."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "edge-infer-compiled-profile.toml"
    path.write_text("[serve]\nenforce_eager = false\n[quant]\ngroup_size = 64\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/results/engine.jsonl"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per cold start")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--modes", default="eager", help="comma list of eager,compiled")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--skip-greedy", action="store_true")
    p.add_argument("--wait", type=float, default=0.0,
                   help="seconds to wait for quiet cores before a cold start is refused")
    p.add_argument("--force", action="store_true",
                   help="time beside foreign load anyway; records say guard: overridden")
    p.add_argument("--allow-dirty", action="store_true",
                   help="append to docs/results from a tree with uncommitted changes")
    args = p.parse_args()
    try:
        require_clean(args.out, args.allow_dirty)
        guard = Guard.on_allowed_cores(threshold=DEFAULT_THRESHOLD, force=args.force,
                                       wait=args.wait)
        if not args.skip_greedy:
            rec = run_greedy(args.out, args.greedy_tokens, guard)
            print(f"greedy W4A16 vs bf16: {rec['exact_matches']}/{rec['prompts']} exact "
                  f"({args.greedy_tokens} tokens), kernels {rec['kernels']}")
        for mode in args.modes.split(","):
            rec = run_cold_start(args.out, args.reps, args.tokens, mode, args.timeout, guard)
            print(f"cold start ({mode}): median first token "
                  f"{rec['first_token_s']['median']:.1f} s, decode "
                  f"{rec['decode_tok_s']['median']:.2f} tok/s (median of {args.reps})")
    except EdgeInferError as exc:  # a refusal, a bad flag: one line, the error's exit code
        print(f"serve smoke: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
