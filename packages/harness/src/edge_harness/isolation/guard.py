"""The contention guard: refuse to time an engine on cores something else is using.

*Measured* on this machine kind: under foreign load, 2 llama.cpp threads collapse from
31 tok/s to 1.3 tok/s decode (its threads spin at barriers waiting for a descheduled peer), so a
number taken on a busy machine is not a slower number, it is a wrong one.

How load is read: per-core busy time from the kernel (psutil.cpu_times(percpu=True):
user+nice+system+irq+softirq+steal) on the chosen cores only.
- Before a measurement: every chosen core must be below `threshold` (a fraction of one core)
  over a `window`.
- During a measurement: the measured child is pinned to the chosen cores, so everything it
  used was spent there; foreign load = (busy time of the chosen cores - CPU time of the
  child's process tree) / (elapsed x cores). Its mean over the run must stay below `threshold`.
A refusal names the processes that used CPU in the window (process CPU times before and after),
and the exit code is non-zero. `--force` runs anyway and the records say `guard: overridden`.

The guard also refuses a misconfigured comparison: engines compared must run on the same
cores, with the same thread count and the same prefix-caching setting (`check_comparable`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil

from edge_infer.errors import EdgeInferError

DEFAULT_THRESHOLD = 0.15  # of one core; an idle desktop sits at 0.01-0.05
DEFAULT_WINDOW = 1.0  # seconds of sampling before each measurement
SETTLE = 0.25  # seconds between a measurement and the next idle check


class GuardRefused(EdgeInferError):
    """The chosen cores are busy (exit code 3)."""

    exit_code = 3


class ComparisonRefused(EdgeInferError):
    """Engines of one comparison differ in cores, threads or prefix caching (exit code 4)."""

    exit_code = 4


@dataclass
class Busy:
    pid: int
    name: str
    cmdline: str
    load: float  # fraction of one core over the window

    def __str__(self) -> str:
        cmd = self.cmdline if len(self.cmdline) <= 80 else self.cmdline[:77] + "..."
        return f"pid {self.pid} {cmd or self.name} ({100 * self.load:.0f}% of a core)"


@dataclass
class Reading:
    phase: str  # "before" | "during"
    seconds: float
    per_core: dict[int, float]  # busy fraction of each chosen core, all processes
    own: float  # cores' worth used by the measured child tree (0 before a run)
    foreign: float  # the number judged: worst core (before) / mean per core (during)
    peak: float  # worst sub-window during a run (= foreign before a run)
    busy: list[Busy] = field(default_factory=list)

    def describe(self) -> str:
        cores = ", ".join(f"cpu{c} {100 * v:.0f}%" for c, v in sorted(self.per_core.items()))
        return f"foreign load {self.foreign:.2f} of a core over {self.seconds:.1f} s ({cores})"


def _busy_seconds(cores: list[int]) -> dict[int, float]:
    times = psutil.cpu_times(percpu=True)
    out = {}
    for c in cores:
        t = times[c]
        out[c] = (t.user + t.nice + t.system + getattr(t, "irq", 0.0)
                  + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0))
    return out


def _process_snapshot() -> dict[int, tuple[str, str, float, frozenset[int] | None, float]]:
    snap = {}
    for p in psutil.process_iter(["name", "cmdline", "cpu_times", "cpu_affinity", "create_time"]):
        info = p.info
        ct = info.get("cpu_times")
        if ct is None:
            continue
        aff = info.get("cpu_affinity")
        snap[p.pid] = (
            info.get("name") or "?",
            " ".join(info.get("cmdline") or []),
            ct.user + ct.system,
            frozenset(aff) if aff else None,
            info.get("create_time") or 0.0,
        )
    return snap


def _tree_cpu(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            ct = psutil.Process(pid).cpu_times()
            total += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return total


def _tree(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def busy_processes(before: dict, after: dict, seconds: float, cores: list[int],
                   exclude: set[int]) -> list[Busy]:
    """Processes that used CPU between two snapshots and may run on `cores`, busiest first."""
    cs = set(cores)
    out = []
    for pid, (name, cmd, cpu, aff, created) in after.items():
        if pid in exclude or (aff is not None and not aff & cs):
            continue
        prev = before.get(pid)
        used = cpu - prev[2] if prev and prev[4] == created else cpu
        load = used / max(seconds, 1e-6)
        if load >= 0.02:
            out.append(Busy(pid, name, cmd, load))
    return sorted(out, key=lambda b: -b.load)


class Guard:
    def __init__(self, cores: list[int], threshold: float = DEFAULT_THRESHOLD,
                 window: float = DEFAULT_WINDOW, force: bool = False, wait: float = 0.0):
        self.cores = list(cores)
        self.threshold = threshold
        self.window = window
        self.force = force
        self.wait = wait
        self.exclude = {psutil.Process().pid}

    # -- before a measurement ------------------------------------------------------------
    def sample_idle(self) -> Reading:
        snap0, busy0, t0 = _process_snapshot(), _busy_seconds(self.cores), time.monotonic()
        time.sleep(self.window)
        busy1, t1, snap1 = _busy_seconds(self.cores), time.monotonic(), _process_snapshot()
        dt = t1 - t0
        per_core = {c: max(0.0, busy1[c] - busy0[c]) / dt for c in self.cores}
        worst = max(per_core.values())
        return Reading("before", dt, per_core, 0.0, worst, worst,
                       busy_processes(snap0, snap1, dt, self.cores, self.exclude))

    def check_idle(self, what: str) -> tuple[str, Reading]:
        """Wait (up to `wait` s) for the cores to be quiet; returns (guard status, reading)."""
        # OpenMP runtimes spin a little after a parallel region before they sleep (libgomp
        # ~ms, Intel's 200 ms): let the engine timed just before settle first.
        time.sleep(SETTLE)
        deadline = time.monotonic() + self.wait
        while True:
            reading = self.sample_idle()
            if reading.foreign <= self.threshold:
                return "ok", reading
            if time.monotonic() >= deadline:
                return self.judge(reading, what), reading

    # -- during a measurement ------------------------------------------------------------
    def watch(self, pid: int) -> Watch:
        return Watch(self, pid)

    # -- verdict -------------------------------------------------------------------------
    def judge(self, reading: Reading, what: str) -> str:
        if reading.foreign <= self.threshold:
            return "ok"
        if self.force:
            return "overridden"
        raise GuardRefused(self.message(reading, what))

    def message(self, reading: Reading, what: str) -> str:
        cores = ",".join(map(str, self.cores))
        busy = "; ".join(str(b) for b in reading.busy[:6]) or (
            "no single process stands out (short-lived processes, interrupts or hypervisor "
            "steal)")
        return (
            f"contention guard: cores {cores} are busy {reading.phase} {what}: "
            f"{reading.describe()}, threshold {self.threshold:.2f}. Busy processes: {busy}. "
            "Wait for them to finish (--wait SECONDS), pick idle cores with --cores, or pass "
            "--force to run anyway and record the results as guard: overridden."
        )


class Watch:
    """Context manager around one measurement of the pinned child `pid`."""

    def __init__(self, guard: Guard, pid: int):
        self.guard = guard
        self.pid = pid
        self.reading: Reading | None = None
        self._stop = threading.Event()
        self._peak = 0.0

    def __enter__(self) -> Watch:
        g = self.guard
        self._tree = _tree(self.pid)
        self._snap0 = _process_snapshot()
        self._busy0, self._own0 = _busy_seconds(g.cores), _tree_cpu(self._tree)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _foreign(self, busy0, own0, t0, busy1, own1, t1) -> float:
        dt = max(t1 - t0, 1e-6)
        total = sum(busy1[c] - busy0[c] for c in self.guard.cores)
        return max(0.0, total - (own1 - own0)) / (dt * len(self.guard.cores))

    def _sample(self) -> None:
        # Cheap sub-window samples (kernel counters only) for the peak; the verdict uses the
        # mean over the whole measurement.
        g = self.guard
        busy0, own0, t0 = self._busy0, self._own0, self._t0
        while not self._stop.wait(max(g.window, 0.5)):
            busy1, own1, t1 = _busy_seconds(g.cores), _tree_cpu(self._tree), time.monotonic()
            self._peak = max(self._peak, self._foreign(busy0, own0, t0, busy1, own1, t1))
            busy0, own0, t0 = busy1, own1, t1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        g = self.guard
        busy1, own1, t1 = _busy_seconds(g.cores), _tree_cpu(self._tree), time.monotonic()
        snap1 = _process_snapshot()
        dt = t1 - self._t0
        foreign = self._foreign(self._busy0, self._own0, self._t0, busy1, own1, t1)
        per_core = {c: max(0.0, busy1[c] - self._busy0[c]) / dt for c in g.cores}
        exclude = g.exclude | self._tree
        self.reading = Reading(
            "during", dt, per_core, (own1 - self._own0) / dt, foreign,
            max(self._peak, foreign),
            busy_processes(self._snap0, snap1, dt, g.cores, exclude),
        )


# -- comparisons ---------------------------------------------------------------------------
COMPARED = ("cores", "threads", "prefix_caching")


def check_comparable(setups: dict[str, dict]) -> None:
    """Refuse engines of one comparison that differ in cores, threads or prefix caching.

    `setups` maps an engine label ("ours:w4a16") to what it runs with, as planned or as the
    child reported after loading (cores from os.sched_getaffinity inside the child, threads
    and prefix caching from the engine itself).
    """
    if len(setups) < 2:
        return
    problems = []
    for key in COMPARED:
        values = {label: _norm(s.get(key)) for label, s in setups.items()}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{label}={v}" for label, v in values.items())
            problems.append(f"{key} differ ({shown})")
    if problems:
        raise ComparisonRefused(
            "misconfigured comparison: " + "; ".join(problems) + ". Engines compared must run "
            "on the same physical cores with the same thread count and prefix caching off for "
            "all; drop the per-engine override, or benchmark the engines in separate runs."
        )


def _norm(v):
    if isinstance(v, (list, tuple, set, frozenset)):
        return ",".join(map(str, sorted(v)))
    return bool(v) if v is None else v
