"""An `edge-infer serve` child process on a free loopback port: start it, wait for /health, stop
it. Used by the serve smoke and soak measurements and by the serve tests.

The child gets its own process group, so that stopping it also stops vLLM's engine core, which
runs in a process of its own.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from edge_infer.errors import EdgeInferError

LOG_TAIL = 3000  # characters of the server's log an error quotes


class ServeFailed(EdgeInferError):
    """The server exited, or did not answer /health in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path | None = None, env: dict[str, str] | None = None,
          cores: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """`edge-infer serve ARGS` on a free port, its output into `log` (or nowhere), the
    environment plus `env`: the process and its base URL, at once (not waiting for /health).
    `cores`: the server is born pinned to them (a benchmark's cores), so every thread vLLM
    starts, the engine core's included, stays there."""
    port = free_port()
    cmd = [sys.executable, "-m", "edge_infer", "serve", "--port", str(port), *args]
    return launch(cmd, log, {**os.environ, **(env or {})}, cores), f"http://127.0.0.1:{port}"


def launch(cmd: list[str], log: Path | None, env: dict[str, str] | None,
           cores: list[int] | None = None) -> subprocess.Popen:
    """Any server command (ours, or llama.cpp's llama-server) in a process group of its own, its
    output into `log` (or nowhere), born pinned to `cores` when given; `env` is the whole
    environment (None: this one)."""
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    with open(log, "w") if log else contextlib.nullcontext(subprocess.DEVNULL) as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin,
                                start_new_session=True, env=env)


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # not listening yet, or an error status
        return False


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float,
                 log: Path | None = None, what: str = "edge-infer serve") -> None:
    """Until /health answers 200 (llama-server: once its model is loaded). ServeFailed, naming
    `what` and quoting the end of `log`, when the server exits first or `timeout` seconds pass
    (the server is then killed)."""
    deadline = time.monotonic() + timeout
    while not healthy(base):
        if proc.poll() is not None:
            raise ServeFailed(f"{what} exited with {proc.returncode}{_tail(log)}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ServeFailed(f"{what} not healthy after {timeout:.0f} s{_tail(log)}")
        time.sleep(1)


def start(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
          cores: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """`edge-infer serve ARGS` (see spawn), once /health answers (see wait_healthy)."""
    proc, base = spawn(args, log, env, cores)
    wait_healthy(proc, base, timeout, log)
    return proc, base


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the server's process group; SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: Path | None) -> str:
    if log is None:
        return ""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return f"; its log {log} ends:\n{text[-LOG_TAIL:]}"
