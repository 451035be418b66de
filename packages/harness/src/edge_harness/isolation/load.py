"""A load generator: one busy process per chosen core, bounded in time.

`edge-infer bench load --cores 0,1 --seconds 30` keeps each core at ~100% with a Python spin
loop (no memory traffic to speak of: it contends for the core, which is what the guard must
see). Every process stops by itself at the deadline, and the parent kills any straggler one
second later, so a forgotten load generator cannot outlive its `--seconds`. Each busy process
also asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), and the command stops
them on SIGTERM as on Ctrl-C: a killed `bench load` leaves no orphan spinning on the core.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _spin(core: int, deadline: float, parent: int) -> None:
    _die_with_parent(parent)
    os.sched_setaffinity(0, {core})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    x = 0
    while time.monotonic() < deadline:
        for _ in range(10000):
            x += 1


class LoadGenerator:
    def __init__(self, cores: list[int], seconds: float):
        if seconds <= 0:
            raise ValueError("--seconds must be positive")
        self.cores = list(cores)
        self.seconds = seconds
        self.procs: list[mp.Process] = []

    def start(self) -> LoadGenerator:
        ctx = mp.get_context("fork")
        self.deadline = time.monotonic() + self.seconds
        for core in self.cores:
            p = ctx.Process(target=_spin, args=(core, self.deadline, os.getpid()), daemon=True,
                            name=f"edge-infer-load-cpu{core}")
            p.start()
            self.procs.append(p)
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self) -> None:
        for p in self.procs:
            p.join(max(0.0, self.deadline - time.monotonic()) + 1.0)
        self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)

    def __enter__(self) -> LoadGenerator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(cores: list[int], seconds: float) -> int:
    def terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    gen = LoadGenerator(cores, seconds).start()
    print(f"load: {len(cores)} busy process(es) on cores {','.join(map(str, cores))} for "
          f"{seconds:g} s (pids {' '.join(map(str, gen.pids))})", file=sys.stderr, flush=True)
    try:
        gen.wait()
    except KeyboardInterrupt:
        gen.stop()
        return 130
    return 0
