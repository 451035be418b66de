"""Pinned child processes and the one-benchmark-at-a-time lock.

An engine never loads in the process that plans the benchmark: each runs in a child started
with its CPU affinity already set (os.sched_setaffinity in the forked child, before exec), so
every thread pool an engine creates (OpenMP, llama.cpp's, vLLM's binding) is born inside the
chosen cores. The child dies with its parent (PR_SET_PDEATHSIG) and when its stdin closes.

Protocol: one JSON object per line on the child's stdin (requests) and on a private copy of
its original stdout (replies); the child points fd 1 at its log so that engines printing to
stdout cannot corrupt the protocol.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edge_infer.api import EdgeInferError

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
PR_SET_PDEATHSIG = 1


class ChildFailed(EdgeInferError):
    pass


def _pin_and_tie_to_parent(cores: list[int]):
    def preexec() -> None:
        os.sched_setaffinity(0, cores)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass

    return preexec


class Worker:
    """One pinned child running `python -m edge_harness.isolation.worker`."""

    def __init__(self, cores: list[int], env: dict[str, str] | None = None,
                 log_path: Path | None = None, label: str = "worker"):
        self.cores = list(cores)
        self.label = label
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"edge-harness-{_safe(label)}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")
        child_env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_harness.isolation.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=child_env, preexec_fn=_pin_and_tie_to_parent(self.cores), close_fds=True,
        )
        self.hello = self._read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, cmd: str, **args: Any) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise ChildFailed(self._died(f"{cmd}: the child had already exited"))
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ChildFailed(self._died(f"{cmd}: the child closed its input")) from None
        reply = self._read()
        if not reply.get("ok"):
            raise ChildFailed(
                f"{self.label}: {cmd} failed in the child: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}(log: {self.log_path})"
            )
        return reply

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise ChildFailed(self._died("no reply"))
        return json.loads(line)

    def _died(self, what: str) -> str:
        code = self.proc.poll()
        self._log.flush()
        tail = _tail(self.log_path)
        return (f"{self.label}: {what} (exit code {code}); last lines of {self.log_path}:\n"
                f"{tail}")

    def close(self, timeout: float = 60) -> None:
        """Ask the child to quit, then make sure it is gone."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- the lock ------------------------------------------------------------------------------
def lock_path() -> Path:
    # One lock per machine, not per EDGE_INFER_HOME: two engineers with different caches
    # must still not benchmark at the same time.
    return Path(os.environ.get("EDGE_HARNESS_LOCK", Path(tempfile.gettempdir())
                               / "edge-infer-bench.lock"))


@contextmanager
def bench_lock(timeout: float = 0.0, path: Path | None = None) -> Iterator[Path]:
    """Hold the machine-wide benchmark lock; wait up to `timeout` s for it, then refuse."""
    path = Path(path or lock_path())
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise EdgeInferError(
                        f"another benchmark holds {path} ({holder}); engines are measured "
                        "strictly one at a time. Wait for it (--lock-wait SECONDS) or stop it."
                    ) from None
                if not said:
                    print(f"waiting for the benchmark lock {path} ({holder})", file=sys.stderr)
                    said = True
                time.sleep(1.0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock
