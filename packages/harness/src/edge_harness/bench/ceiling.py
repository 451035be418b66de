"""The streaming-read ceiling: how many GB/s the chosen cores can pull from memory.

Method: one process per chosen core, each pinned to its core, each owning a 1 GiB float32
array (filled first, so its pages exist; far larger than any last-level cache). For each pass
all processes meet at a barrier, then each runs `numpy.max` over its array -- a vectorized
reduction that does one compare per 4 bytes and so is limited by memory, not arithmetic (on
this Zen 3 it beat f64/i64/u8 max, sum and bitwise-or reductions). A pass's bandwidth is
(bytes read by all processes) / (last finish - first start); the ceiling is the best pass,
and every pass is kept as a sample.

Decode reads every weight once per token, so a decode's achieved GB/s (weight bytes per
token x tok/s) over this ceiling says how close an engine runs to the memory wall
(*measured* on this machine: ~15 GB/s one core, ~26 GB/s two).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

GIB = 1 << 30


def _reader(core: int, nbytes: int, passes: int, barrier, results) -> None:
    os.sched_setaffinity(0, {core})
    a = np.ones(nbytes // 4, dtype=np.float32)
    a.max()  # touch once outside the timing
    for i in range(passes):
        barrier.wait()
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        a.max()
        t1 = time.perf_counter()
        results.put((core, i, t0, t1, a.nbytes))


def measure(cores: list[int], gib_per_core: float = 1.0, passes: int = 5) -> dict:
    """Run the ceiling on `cores`; returns per-pass GB/s and the best."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(cores))
    results = ctx.Queue()
    nbytes = int(gib_per_core * GIB)
    procs = [ctx.Process(target=_reader, args=(c, nbytes, passes, barrier, results))
             for c in cores]
    for p in procs:
        p.start()
    rows = [results.get(timeout=600) for _ in range(len(cores) * passes)]
    for p in procs:
        p.join()
    per_pass = []
    for i in range(passes):
        r = [row for row in rows if row[1] == i]
        span = max(x[3] for x in r) - min(x[2] for x in r)
        per_pass.append(sum(x[4] for x in r) / span / 1e9)
    return {"samples_gbs": per_pass, "ceiling_gbs": max(per_pass),
            "bytes_per_core": nbytes, "cores": list(cores), "method": "numpy float32 max"}


def measure_guarded(guard, gib_per_core: float = 1.0, passes: int = 5):
    """`measure` on `guard.cores`, idle-checked before and watched throughout: the readers
    are our children, so the watch follows this process's tree. Returns (result, Verdict)."""
    what = "the bandwidth ceiling"
    verdict = guard.verdict()
    res = guard.measure(os.getpid(), what, verdict, measure, guard.cores, gib_per_core, passes)
    return res, verdict
