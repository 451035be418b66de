"""Soak: mixed load against a real `edge-infer serve`, with nothing lost (run by `nox -s soak`;
a 20-second version runs in the serve tests).

Loopback only, bounded in time and in requests. Each client loops until the time is up,
drawing each request from a seeded mix:
- 5% bad requests (a malformed body, max_tokens 0, an unknown chat role): must be a 4xx;
- 10% streams cancelled after their first chunk: the client hangs up, the server carries on;
- the rest short or long prompts, streamed or not, completions or chat: must finish.

Recorded (docs/results/soak.jsonl): requests sent, answered, failed (anything unexpected:
a 5xx, a dropped connection, a bad request answered 2xx), cancelled, p50/p99 latency of the
answered requests, the server's RSS (its process tree) after warm-up and at the end, and
whether it still answers afterwards. The exit status is non-zero unless nothing failed, RSS
grew by at most 10% and the server still answers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from edge_infer.guard import Guard
from edge_infer.models.registry import DEFAULT_MODEL
from edge_infer.results import append, command_line, context, require_clean
from edge_infer.serve import auth, process

BAD_SHARE, CANCEL_SHARE = 0.05, 0.10
LONG_PROMPT = "Summarize the following notes. " + "The quick brown fox jumps over the lazy dog. " * 40
SHORT_PROMPTS = ("Hello", "The capital of France is", "1, 2, 3,", "Write a haiku about rain.")


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    cancelled: int = 0
    bad_sent: int = 0
    bad_rejected: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, seconds: float, detail: str = "") -> None:
        with self.lock:
            self.sent += 1
            if outcome == "answered":
                self.answered += 1
                self.latencies.append(seconds)
            elif outcome == "cancelled":
                self.cancelled += 1
            elif outcome == "rejected":
                self.bad_sent += 1
                self.bad_rejected += 1
            else:
                self.bad_sent += outcome == "bad-accepted"
                self.failures.append(f"{outcome}: {detail}"[:300])


def pick(rng: random.Random, model: str) -> tuple[str, str, dict | bytes]:
    """(kind, path, body) of one request from the mix."""
    r = rng.random()
    if r < BAD_SHARE:
        return "bad", *rng.choice([
            ("/v1/completions", b'{"model": "%s", "prompt": ' % model.encode()),
            ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 0}),
            ("/v1/chat/completions", {"model": model, "messages": [
                {"role": "wizard", "content": "hi"}]}),
        ])
    stream = r < BAD_SHARE + CANCEL_SHARE or rng.random() < 0.5
    kind = "cancel" if r < BAD_SHARE + CANCEL_SHARE else ("stream" if stream else "plain")
    prompt = LONG_PROMPT if rng.random() < 0.25 else rng.choice(SHORT_PROMPTS)
    tokens = rng.choice((8, 16, 32, 64))
    if rng.random() < 0.5:
        return kind, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": tokens,
                                         "temperature": 0.7, "stream": stream}
    return kind, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens, "temperature": 0.7, "stream": stream}


def one_request(base: str, key: str, kind: str, path: str, body, tally: Tally) -> None:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=data, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        if kind == "bad":
            resp.read()
            ok = 400 <= resp.status < 500
            tally.add("rejected" if ok else "bad-accepted", 0, f"{path} -> {resp.status}")
            return
        if resp.status != 200:
            tally.add("error", 0, f"{path} -> {resp.status} {resp.read()[:200]!r}")
            return
        if kind == "cancel":
            if not resp.readline():
                tally.add("error", 0, f"{path}: stream ended before its first chunk")
                return
            conn.close()  # hang up mid-stream
            tally.add("cancelled", time.monotonic() - t0)
            return
        if kind == "stream":
            done = False
            for line in resp:
                done = done or line.strip() == b"data: [DONE]"
            if not done:
                tally.add("error", 0, f"{path}: stream ended without [DONE]")
                return
        else:
            answer = json.loads(resp.read())
            if not answer.get("choices"):
                tally.add("error", 0, f"{path}: no choices in {str(answer)[:200]}")
                return
        tally.add("answered", time.monotonic() - t0)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        tally.add("error", 0, f"{path}: {type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_load(base: str, key: str, model: str, clients: int, seconds: float, seed: int,
             max_requests: int) -> Tally:
    """`clients` threads sending the mix until `seconds` pass or `max_requests` are sent."""
    tally, deadline = Tally(), time.monotonic() + seconds
    budget = threading.Semaphore(max_requests)

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline and budget.acquire(blocking=False):
            one_request(base, key, *pick(rng, model), tally)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def tree_rss_mib(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def answers(base: str, key: str, model: str) -> bool:
    tally = Tally()
    one_request(base, key, "plain", "/v1/completions",
                {"model": model, "prompt": "Hello", "max_tokens": 4}, tally)
    return tally.answered == 1


def summary(tally: Tally, clients: int, seconds: float, seed: int) -> dict:
    lat = sorted(tally.latencies)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

    return {
        "clients": clients, "seconds": seconds, "seed": seed,
        "sent": tally.sent, "answered": tally.answered, "cancelled": tally.cancelled,
        "bad_sent": tally.bad_sent, "bad_rejected": tally.bad_rejected,
        "failed": len(tally.failures), "failures": tally.failures[:20],
        "latency_s": {"p50": pct(0.50), "p99": pct(0.99),
                      "median": round(statistics.median(lat), 3) if lat else None},
    }


def served_name(base: str, key: str) -> str:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help=f"model to serve (default: {DEFAULT_MODEL}'s build)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (10)")
    p.add_argument("--clients", type=int, default=24, help="concurrent clients (24; 16-32)")
    p.add_argument("--max-requests", type=int, default=20000, help="stop after this many (20000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (0)")
    p.add_argument("--out", type=Path, default=Path("docs/results/soak.jsonl"),
                   help="JSONL file the record is appended to")
    p.add_argument("--allow-dirty", action="store_true",
                   help="append to docs/results from a tree with uncommitted changes")
    p.add_argument("--log", type=Path, default=Path("soak-serve.log"), help="the server's log")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for /health")
    args = p.parse_args()
    if not 0 < args.minutes <= 120 or not 1 <= args.clients <= 256:
        p.error("--minutes must be in (0, 120] and --clients in 1..256")
    require_clean(args.out, args.allow_dirty)
    # provenance of the code that runs: taken now, not after minutes of load
    provenance = context(threads=len(os.sched_getaffinity(0)))
    key = secrets.token_urlsafe(24)
    try:
        proc, base = process.start([args.model] if args.model else [], args.log, args.timeout,
                                   env={auth.KEY_ENV: key})
    except process.ServeFailed as exc:
        raise SystemExit(f"soak: {exc}") from None
    # a load test, not a speed figure (latencies under deliberately mixed load): observed by
    # the guard, never retaken or refused; the record says what ran beside it
    guard = Guard.on_allowed_cores()
    with guard.observe("soak") as verdict:
        try:
            model = served_name(base, key)
            warm = run_load(base, key, model, args.clients, 20, args.seed + 1, 10**6)
            rss_start = tree_rss_mib(proc.pid)
            print(f"soak: warm-up {warm.sent} requests; RSS {rss_start:.0f} MiB; "
                  f"{args.clients} clients for {args.minutes:g} min", file=sys.stderr, flush=True)
            tally = run_load(base, key, model, args.clients, args.minutes * 60, args.seed,
                             args.max_requests)
            rss_end = tree_rss_mib(proc.pid)
            alive = answers(base, key, model)
        finally:
            process.stop(proc)
    growth = rss_end / rss_start - 1
    rec = {
        **provenance,
        "kind": "soak", "model": model,
        "command": command_line(),
        "cores": guard.cores,
        **verdict.fields(),
        **summary(tally, args.clients, args.minutes * 60, args.seed),
        "warmup_requests": warm.sent,
        "rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1),
                    "growth": round(growth, 4)},
        "alive_after": alive,
    }
    append(args.out, rec)
    ok = rec["failed"] == 0 and growth <= 0.10 and alive
    print(f"soak: sent {rec['sent']}, answered {rec['answered']}, cancelled {rec['cancelled']}, "
          f"bad {rec['bad_rejected']}/{rec['bad_sent']} rejected, failed {rec['failed']}; "
          f"p50 {rec['latency_s']['p50']} s, p99 {rec['latency_s']['p99']} s; "
          f"RSS {rss_start:.0f} -> {rss_end:.0f} MiB ({growth:+.1%}); "
          f"alive after: {alive} -> {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
