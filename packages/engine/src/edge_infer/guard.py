"""The contention guard: refuse to time an engine on cores something else is using.

*Measured* on this machine kind: under foreign load, 2 llama.cpp threads collapse from
31 tok/s to 1.3 tok/s decode (its threads spin at barriers waiting for a descheduled peer), so a
number taken on a busy machine is not a slower number, it is a wrong one.

How load is read: per-core busy time from the kernel (psutil.cpu_times(percpu=True):
user+nice+system+irq+softirq+steal) on the chosen cores and their SMT siblings only. A sibling
(thread_siblings_list) shares the core's execution units, so its load counts against the core.
- Before a measurement: every chosen core must be below `threshold` (a fraction of one core)
  over a `window`.
- During a measurement: the measured child is pinned to the chosen cores, so everything it
  used was spent there; foreign load = (busy time of the chosen cores - CPU time of the
  child's process tree) / (elapsed x cores). Two numbers must stay below `threshold`: the
  mean over the run, and the peak -- the worst one core over any `sub_window` (0.5 s), or over
  1% of the run where that is longer (PEAK_SHARE). The mean alone passes a one-core burst: a
  core taken for 1 s of a 10 s run on 2 cores is 0.05. The peak's window grows with the run
  because a burst matters by its share of the run: in a 6-minute serving run a 0.5 s blip
  (a shared VM's steal, a short-lived process) moves the result by under 0.1%, and judged
  at 0.5 s every long run on such a machine was refused; a core taken for 1% of the run
  still reads 1.0 and is refused. The window of the peak is recorded (`guard_peak_window`).
A refusal names the processes that used CPU in the window (process CPU times before and after),
and the exit code is non-zero. `--force` runs anyway and the records say `guard: overridden`.
Every record says what the guard saw (`Verdict.fields`: mean, peak, threshold, windows).

A job that is recorded but is not a benchmark (an export, a fidelity or HumanEval run, a greedy
comparison) runs under `Guard.observe`: the same readings before and during, never retaken or
refused (a 10-minute export is not thrown away for a one-second blip), and its record says
`guard: ok` or `guard: contended` beside the wall time it reports.

It lives in the engine so that every timing of every package is judged by one guard: the
harness's benchmarks, and the engine's own serve smoke.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from edge_infer.errors import EdgeInferError
from edge_infer.topology import SYS_CPU, siblings

DEFAULT_THRESHOLD = 0.15  # of one core; an idle desktop sits at 0.01-0.05
DEFAULT_WINDOW = 1.0  # seconds of sampling before each measurement
SUB_WINDOW = 0.5  # seconds per sample during a run; /proc/stat ticks are 10 ms, so 2% steps
PEAK_SHARE = 0.01  # the peak's window: at least this share of the run (and sub_window)
SETTLE = 0.25  # seconds between a measurement and the next idle check
REMEASURE = 3  # measurements per record that may be thrown away for foreign load and retaken
TICK = 1.0 / os.sysconf("SC_CLK_TCK")  # the resolution of /proc/stat and /proc/PID/stat


def tick_slack(seconds: float) -> float:
    """What the tick counters cannot resolve over `seconds`: one tick at each end of the
    window, as a fraction of one core (0.04 over a 0.5 s sub-window, 0.002 over 10 s)."""
    return 2 * TICK / max(seconds, 1e-6)


class GuardRefused(EdgeInferError):
    """The chosen cores are busy (exit code 3)."""

    exit_code = 3


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
    per_core: dict[int, float]  # busy fraction of each chosen core (+ its siblings), all processes
    own: float  # cores' worth used by the measured child tree (0 before a run)
    foreign: float  # worst core (before) / mean per core over the whole run (during)
    peak: float  # worst one core over a sub-window (during); = foreign before a run
    busy: list[Busy] = field(default_factory=list)
    peak_core: int | None = None  # the core of `peak`
    peak_seconds: float = 0.0  # length of the sub-window of `peak`

    def describe(self) -> str:
        cores = ", ".join(f"cpu{c} {100 * v:.0f}%" for c, v in sorted(self.per_core.items()))
        text = f"foreign load {self.foreign:.2f} of a core over {self.seconds:.1f} s ({cores})"
        if self.phase == "during" and self.peak_core is not None:
            text += (f", worst one core cpu{self.peak_core} {self.peak:.2f} over "
                     f"{self.peak_seconds:.1f} s")
        return text


@dataclass(frozen=True)
class Sample:
    """Cumulative counters at one instant, as /proc/stat and /proc/PID/stat give them."""

    t: float  # monotonic seconds
    busy: dict[int, float]  # busy seconds of each watched CPU (chosen cores and SMT siblings)
    own: float = 0.0  # CPU seconds of the measured process tree


def foreign_load(a: Sample, b: Sample, cores: list[int],
                 sibs: dict[int, list[int]]) -> tuple[float, dict[int, float], dict[int, float]]:
    """(mean foreign load per core, foreign load of each core, busy of each core) from a to b.

    Busy time of a core's SMT siblings is all foreign (the child is pinned to `cores`). The
    child's own time cannot be placed on a core from these counters, so the foreign time of
    the chosen cores is split over them in proportion to their busy time: an engine alone
    reads 0 on every core however uneven its threads, an idle engine's cores read exactly
    their foreign load, and the worst core never reads below the mean.
    """
    dt = max(b.t - a.t, 1e-6)

    def rate(c: int) -> float:
        return max(0.0, b.busy.get(c, 0.0) - a.busy.get(c, 0.0)) / dt

    busy = {c: rate(c) for c in cores}
    total = sum(busy.values())
    foreign = max(0.0, total - max(0.0, b.own - a.own) / dt)
    sib = {c: sum(rate(s) for s in sibs.get(c, ())) for c in cores}
    per_core = {c: (busy[c] * foreign / total if total > 0 else 0.0) + sib[c] for c in cores}
    return (foreign + sum(sib.values())) / len(cores), per_core, {c: busy[c] + sib[c] for c in cores}


@dataclass
class Verdict:
    """What the guard saw over the measurements of one record, in the record's fields."""

    threshold: float
    window: float
    sub_window: float
    status: str = "ok"
    mean: float = 0.0  # worst mean foreign load of one measurement (worst core before one)
    peak: float = 0.0  # worst one core over a sub-window
    peak_window: float = 0.0  # the longest window a peak was judged over (PEAK_SHARE)
    remeasured: int = 0  # measurements thrown away for foreign load and taken again (REMEASURE)

    def add(self, status: str, reading: Reading) -> Verdict:
        if status != "ok":  # "overridden" (a timing under --force) or "contended" (observe)
            self.status = status
        self.mean = max(self.mean, reading.foreign)
        self.peak = max(self.peak, reading.peak)
        if reading.phase == "during":
            self.peak_window = max(self.peak_window, reading.peak_seconds)
        return self

    def fields(self) -> dict:
        return {"guard": self.status, "guard_foreign_load": round(max(self.mean, self.peak), 4),
                "guard_mean_load": round(self.mean, 4), "guard_peak_load": round(self.peak, 4),
                "guard_threshold": self.threshold, "guard_window": self.window,
                "guard_sub_window": self.sub_window, "guard_peak_window": round(self.peak_window, 3),
                "guard_remeasured": self.remeasured}


def _busy_seconds(cpus) -> dict[int, float]:
    times = psutil.cpu_times(percpu=True)
    out = {}
    for c in cpus:
        if c >= len(times):  # an offline sibling: nothing runs there
            continue
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
    # children_* hold the time of reaped children: a process of the tree that exits between
    # two samples moves its time to its parent instead of taking it out of the sum.
    total = 0.0
    for pid in pids:
        try:
            ct = psutil.Process(pid).cpu_times()
            total += ct.user + ct.system + ct.children_user + ct.children_system
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
                 window: float = DEFAULT_WINDOW, force: bool = False, wait: float = 0.0,
                 sub_window: float = SUB_WINDOW, topology: Path = SYS_CPU):
        self.cores = list(cores)
        self.threshold = threshold
        self.window = window
        self.sub_window = sub_window
        self.force = force
        self.wait = wait
        self.exclude = {psutil.Process().pid}
        chosen = set(self.cores)
        self.siblings = {c: sorted(siblings(c, topology) - chosen) for c in self.cores}
        self.watched = sorted(chosen.union(*map(set, self.siblings.values())))

    @classmethod
    def on_allowed_cores(cls, **options) -> Guard:
        """A guard over the cores this process may run on (its affinity mask): the cores a
        recorded job that takes no --cores of its own is actually using."""
        return cls(sorted(os.sched_getaffinity(0)), **options)

    def status_of(self, reading: Reading) -> str:
        """The verdict on one reading of a watched (never refused) job."""
        return "ok" if self.quiet(reading) else "contended"

    def verdict(self) -> Verdict:
        return Verdict(self.threshold, self.window, self.sub_window)

    def sample(self, own: float = 0.0) -> Sample:
        return Sample(time.monotonic(), _busy_seconds(self.watched), own)

    # -- before a measurement ------------------------------------------------------------
    def sample_idle(self) -> Reading:
        snap0, s0 = _process_snapshot(), self.sample()
        time.sleep(self.window)
        s1, snap1 = self.sample(), _process_snapshot()
        return self.reading_before(s0, s1, busy_processes(snap0, snap1, s1.t - s0.t,
                                                          self.watched, self.exclude))

    def reading_before(self, s0: Sample, s1: Sample, busy: list[Busy] = ()) -> Reading:
        _, per_core, _ = foreign_load(s0, s1, self.cores, self.siblings)
        core = max(per_core, key=per_core.get)
        return Reading("before", s1.t - s0.t, per_core, 0.0, per_core[core], per_core[core],
                       list(busy), core, s1.t - s0.t)

    def check_idle(self, what: str) -> tuple[str, Reading]:
        """Wait (up to `wait` s) for the cores to be quiet; returns (guard status, reading)."""
        # OpenMP runtimes spin a little after a parallel region before they sleep (libgomp
        # ~ms, Intel's 200 ms): let the engine timed just before settle first.
        time.sleep(SETTLE)
        deadline = time.monotonic() + self.wait
        while True:
            reading = self.sample_idle()
            if self.quiet(reading):
                return "ok", reading
            if time.monotonic() >= deadline:
                return self.judge(reading, what), reading

    # -- during a measurement ------------------------------------------------------------
    def watch(self, pid: int | Iterable[int]) -> Watch:
        return Watch(self, pid)

    def reading_during(self, samples: list[Sample], busy: list[Busy] = ()) -> Reading:
        """The reading of one measurement from its samples (one per sub-window, first at the
        start, last at the end): the mean over all of it, the peak over each sub-window."""
        first, last = samples[0], samples[-1]
        mean, _, per_core = foreign_load(first, last, self.cores, self.siblings)
        points = list(samples)
        if len(points) > 2 and last.t - points[-2].t < self.sub_window / 2:
            del points[-2]  # a short tail would read in coarse 10 ms ticks: join it to the last
        span = max(self.sub_window, PEAK_SHARE * (last.t - first.t))
        windows, start = [], points[0]
        for p in points[1:]:  # consecutive sub-windows joined until each spans `span`
            if p.t - start.t >= 0.999 * span or p is points[-1]:
                windows.append((start, p))
                start = p
        if len(windows) > 1 and windows[-1][1].t - windows[-1][0].t < span / 2:
            windows[-2:] = [(windows[-2][0], windows[-1][1])]  # a short last window: joined
        peak, peak_core, peak_seconds = mean, None, last.t - first.t
        for a, b in windows:
            _, cores, _ = foreign_load(a, b, self.cores, self.siblings)
            core = max(cores, key=cores.get)
            if peak_core is None or cores[core] > peak:
                peak, peak_core, peak_seconds = cores[core], core, b.t - a.t
        dt = max(last.t - first.t, 1e-6)
        return Reading("during", dt, per_core, max(0.0, last.own - first.own) / dt, mean,
                       peak, list(busy), peak_core, peak_seconds)

    # -- verdict -------------------------------------------------------------------------
    def quiet(self, reading: Reading) -> bool:
        """Both numbers at or below the threshold, give or take what the counters can resolve
        over their window (`tick_slack`): a 0.1 s tg8 reads 10 ticks per core, where one tick
        read early or late at either end is already 0.2 of a core."""
        peak_seconds = reading.peak_seconds or reading.seconds
        return (reading.foreign <= self.threshold + tick_slack(reading.seconds)
                and reading.peak <= self.threshold + tick_slack(peak_seconds))

    def keep(self, reading: Reading, what: str, verdict: Verdict, say=print) -> bool:
        """Whether the measurement just read is kept. One taken under foreign load is thrown
        away and taken again (after the usual wait for quiet cores), up to REMEASURE times per
        record, and the record counts them; past that, the guard judges it as always (refused,
        or overridden under --force). A shared machine's one-second blip then costs one
        repetition, not the run, and no contended sample is ever published as ok."""
        if not self.quiet(reading) and not self.force and verdict.remeasured < REMEASURE:
            verdict.remeasured += 1
            say(f"guard: {what} ran beside foreign load ({reading.describe()}): thrown away and "
                f"measured again ({verdict.remeasured}/{REMEASURE} for this record)")
            return False
        verdict.add(self.judge(reading, what), reading)
        return True

    def measure(self, pid: int, what: str, verdict: Verdict, take, *args, say=print, **kwargs):
        """`take(*args, **kwargs)` once the cores are quiet (check_idle), under the watch of
        `pid`'s tree; taken again while `keep` throws the take away. Returns what the kept
        take returned."""
        while True:
            verdict.add(*self.check_idle(what))
            with self.watch(pid) as watch:
                result = take(*args, **kwargs)
            if self.keep(watch.reading, what, verdict, say):
                return result

    @contextmanager
    def observe(self, what: str, pid: int | Iterable[int] | None = None) -> Iterator[Verdict]:
        """Watch a job that is recorded but is not a benchmark (its wall time is in its
        record): the cores before it, then the tree of `pid` (or of each pid given: e.g. this
        process and the containers it drives; default: this process) during it. The
        verdict yielded is complete once the block ends: "ok", or "contended" where foreign
        load passed the threshold before or during it; never refused, never retaken."""
        verdict = self.verdict()
        contended = []

        def add(reading: Reading) -> None:
            verdict.add(status := self.status_of(reading), reading)
            if status != "ok":
                contended.append(reading)

        add(self.sample_idle())
        with self.watch(os.getpid() if pid is None else pid) as watch:
            yield verdict
        add(watch.reading)
        if contended:
            said = "; ".join(f"{r.phase} it: {r.describe()}" for r in contended)
            print(f"guard: {what} ran beside foreign load ({said}); its record says guard: "
                  "contended", flush=True)

    def judge(self, reading: Reading, what: str) -> str:
        if self.quiet(reading):
            return "ok"
        if self.force:
            return "overridden"
        raise GuardRefused(self.message(reading, what))

    def message(self, reading: Reading, what: str) -> str:
        cores = ",".join(map(str, self.cores))
        sibs = sorted(s for ss in self.siblings.values() for s in ss)
        busy = "; ".join(str(b) for b in reading.busy[:6]) or (
            "no single process stands out (short-lived processes, interrupts or hypervisor "
            "steal)")
        return (
            f"contention guard: cores {cores}"
            + (f" (with SMT siblings {','.join(map(str, sibs))})" if sibs else "")
            + f" are busy {reading.phase} {what}: "
            f"{reading.describe()}, threshold {self.threshold:.2f}. Busy processes: {busy}. "
            "Wait for them to finish (--wait SECONDS), pick idle cores with --cores, or pass "
            "--force to run anyway and record the results as guard: overridden."
        )


class Watch:
    """Context manager around one measurement of the pinned child `pid` (and its children,
    also those started during the measurement); of each of several such roots where `pid` is
    a list (their trees' CPU time is all the measured job's own)."""

    def __init__(self, guard: Guard, pid: int | Iterable[int]):
        self.guard = guard
        self.pids = [pid] if isinstance(pid, int) else list(pid)
        self.reading: Reading | None = None
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._tree: set[int] = set()

    def _now(self) -> Sample:
        tree = set().union(*map(_tree, self.pids))
        self._tree |= tree
        return self.guard.sample(_tree_cpu(tree))

    def __enter__(self) -> Watch:
        self._snap0 = _process_snapshot()
        self.samples = [self._now()]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        # Kernel counters only, cheap enough for every sub-window.
        while not self._stop.wait(self.guard.sub_window):
            self.samples.append(self._now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        g = self.guard
        self.samples.append(self._now())
        snap1 = _process_snapshot()
        dt = self.samples[-1].t - self.samples[0].t
        busy = busy_processes(self._snap0, snap1, dt, g.watched, g.exclude | self._tree)
        self.reading = g.reading_during(self.samples, busy)
