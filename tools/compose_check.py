"""deploy/compose.yaml for real (`nox -s deploy-compose`): bring up two replicas behind HAProxy
with podman-compose, send 200 completions across them, kill one replica mid-run, and count what
the clients saw.

    python tools/compose_check.py [--requests 200] [--clients 8] [--kill-after 60]
    python tools/compose_check.py --measure [--record docs/results/scale.jsonl]
    python tools/compose_check.py --table docs/results/scale.jsonl

--measure times the same total cores two ways instead: two replicas of one core each, then one
replica of two cores, each under the same concurrent load (completion tokens per second over
the whole run), and appends one JSON record per layout to --record; --table prints the
markdown table of docs/scale-out.md from those records.

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


def measure(args: argparse.Namespace) -> int:
    for layout, (services, cpus, n, threads) in LAYOUTS.items():
        samples, tokens = [], 0
        with running(services, args.start_timeout, cpus) as (_, base, key, _port, model):
            log(f"{layout}: {n} replica(s) x {threads} thread(s): warm-up, then {args.rounds} "
                f"round(s) of {args.requests} completions of {args.max_tokens} tokens, "
                f"{args.clients} at once")
            with ThreadPoolExecutor(args.clients) as pool:  # warm-up: one request per client
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
        commit, dirty = git_state()
        rec = {"kind": "scale_out", "layout": layout, "replicas": n, "threads_per_replica": threads,
               "total_cores": n * threads, "clients": args.clients, "requests": args.requests,
               "max_tokens": args.max_tokens, "completion_tokens": tokens, "tok_s": samples,
               "tok_s_median": statistics.median(samples), "model": model,
               "cpu_model": cpu_model(), "git_commit": commit, "git_dirty": dirty,
               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "python tools/compose_check.py " + " ".join(sys.argv[1:])}
        print(json.dumps(rec), flush=True)
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def git_state() -> tuple[str | None, bool | None]:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    return (head or None), (bool(status.stdout.strip()) if status.returncode == 0 else None)


def table(path: Path) -> str:
    """The markdown table of docs/scale-out.md: the newest record of each layout."""
    newest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("kind") == "scale_out":
                newest[(rec["cpu_model"], rec["layout"], rec["clients"], rec["max_tokens"])] = rec
    rows = ["| CPU | layout | replicas x threads | clients | tokens | tok/s median | tok/s per round "
            "| commit |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in newest.values():
        rounds = ", ".join(f"{x:.1f}" for x in r["tok_s"])
        commit = f"{r['git_commit']}{' (dirty)' if r['git_dirty'] else ''}"
        rows.append(f"| {r['cpu_model']} | {r['layout']} | {r['replicas']} x {r['threads_per_replica']} "
                    f"| {r['clients']} | {r['max_tokens']} | {r['tok_s_median']:.1f} | {rounds} | {commit} |")
    return "\n".join(rows) + "\n"


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
    ap.add_argument("--record", type=Path, help="JSONL the --measure records are appended to")
    ap.add_argument("--table", type=Path, metavar="JSONL", help="print the table of these records")
    args = ap.parse_args(argv)
    if args.table:
        if not args.table.is_file():
            ap.error(f"--table {args.table}: no such file; make it with --measure --record")
        sys.stdout.write(table(args.table))
        return 0
    if min(args.requests, args.clients, args.rounds, args.max_tokens) < 1:
        ap.error("--requests, --clients, --rounds and --max-tokens: at least 1")
    if args.measure:
        return measure(args)
    if not 0 < args.kill_after < args.requests:
        ap.error(f"--kill-after {args.kill_after}: choose 1..{args.requests - 1}")
    return kill_check(args)


if __name__ == "__main__":
    sys.exit(main())
