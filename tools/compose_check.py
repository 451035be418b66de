"""deploy/compose.yaml for real (`nox -s deploy-compose`): bring up two replicas behind HAProxy
with podman-compose, send 200 completions across them, kill one replica mid-run, and count what
the clients saw.

    python tools/compose_check.py [--requests 200] [--clients 8] [--kill-after 60]

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
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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


def wait_up(stack: Stack, stats_port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            st = {k: v["status"] for k, v in stats(stats_port).items()}
        except OSError:
            st = {}
        now = ", ".join(f"{k} {v}" for k, v in sorted(st.items())) or "balancer not answering"
        if now != last:
            log(f"waiting for both replicas: {now}")
            last = now
        if len(st) == 2 and all(v == "UP" for v in st.values()):
            return
        time.sleep(3)
    raise SystemExit(f"compose-check: replicas not UP within {timeout:.0f} s ({last})\n"
                     + "\n".join(f"--- {s} ---\n{stack.logs(s)}" for s in REPLICAS))


def request(base: str, key: str, model: str, i: int) -> Outcome:
    body = json.dumps({"model": model, "prompt": f"Request {i}: the capital of France is",
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            data = json.loads(r.read())
            ok = bool(data["choices"][0]["text"] is not None)
            return Outcome(t0, time.monotonic(), r.status if ok else None,
                           r.headers.get("X-Edge-Replica"))
    except urllib.error.HTTPError as exc:
        return Outcome(t0, time.monotonic(), exc.code, exc.headers.get("X-Edge-Replica"),
                       exc.read().decode(errors="replace")[:200])
    except Exception as exc:  # no HTTP answer: reset, timeout, truncated body
        return Outcome(t0, time.monotonic(), None, None, f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once (8)")
    ap.add_argument("--kill-after", type=int, default=60,
                    help="kill replica-a once this many requests are answered (60)")
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds for both replicas to pass HAProxy's health check (900)")
    args = ap.parse_args(argv)
    if not 0 < args.kill_after < args.requests:
        ap.error(f"--kill-after {args.kill_after}: choose 1..{args.requests - 1}")

    key = secrets.token_hex(16)
    port, stats_port = free_port(), free_port()
    env = {**os.environ, "EDGE_INFER_API_KEY": key, "EDGE_INFER_LB_PORT": str(port),
           "EDGE_INFER_LB_STATS_PORT": str(stats_port)}
    if "EDGE_INFER_BASE_IMAGE" not in env and subprocess.run(
            ["podman", "image", "exists", LOCAL_BASE]).returncode == 0:
        env["EDGE_INFER_BASE_IMAGE"] = LOCAL_BASE
    stack = Stack(f"edge-infer-check-{secrets.token_hex(3)}", env)
    base = f"http://127.0.0.1:{port}"
    try:
        log("building the balancer image (HAProxy from Debian)")
        stack.run("build", "lb")
        log(f"starting {stack.project}: two replicas (a minute or three) and the balancer")
        stack.run("up", "-d")
        wait_up(stack, stats_port, args.start_timeout)
        req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        log(f"both replicas UP; {args.requests} completions of {model}, {args.clients} at once; "
            f"replica-a is killed after {args.kill_after} answers")

        done = 0
        lock = threading.Lock()
        killed_at: list[float] = []

        def one(i: int) -> Outcome:
            nonlocal done
            out = request(base, key, model, i)
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
        after = stats(stats_port)
    finally:
        log("taking the stack down")
        stack.run("down", "-t", "5", check=False, timeout=300)

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


if __name__ == "__main__":
    sys.exit(main())
