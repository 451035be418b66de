"""Physical cores from the Linux CPU topology: one logical CPU per core, never two hyper-threads.

Two hyper-threads of one core share its execution units and caches; timing two threads there
and calling it "2 cores" overstates what a second core buys. Siblings are read from
/sys/devices/system/cpu/cpuN/topology/{core_cpus_list,thread_siblings_list}.
"""

from __future__ import annotations

import os
from pathlib import Path

from edge_infer.errors import UsageError

SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


def siblings(cpu: int, root: Path = SYS_CPU) -> frozenset[int]:
    """The logical CPUs sharing `cpu`'s physical core (itself included)."""
    topo = root / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        path = topo / name
        if path.is_file():
            return frozenset(parse_cpu_list(path.read_text()))
    return frozenset({cpu})  # no topology exposed: treat each CPU as its own core


def physical_cores(allowed: list[int] | None = None, root: Path = SYS_CPU) -> list[int]:
    """One CPU id per physical core among `allowed` (default: this process's affinity):
    the lowest-numbered allowed sibling of each core."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    chosen: list[int] = []
    covered: set[int] = set()
    for cpu in cpus:
        if cpu in covered:
            continue
        covered |= siblings(cpu, root)
        chosen.append(cpu)
    return chosen


def choose_cores(requested: str | None, threads: int | None, root: Path = SYS_CPU) -> list[int]:
    """The cores a benchmark pins to: `--cores` (validated) or every physical core we may use,
    cut to the first `threads` of them. One thread per core: threads == len(cores)."""
    allowed = sorted(os.sched_getaffinity(0))
    if requested:
        try:
            cores = parse_cpu_list(requested)
        except ValueError:
            raise UsageError(f"--cores {requested!r}: expected a list like 0,1 or 0-3") from None
        missing = sorted(set(cores) - set(allowed))
        if missing:
            raise UsageError(f"--cores {requested}: CPUs {missing} are not available to this "
                             f"process (allowed: {allowed})")
        for i, a in enumerate(cores):
            for b in cores[i + 1:]:
                if b in siblings(a, root):
                    raise UsageError(
                        f"--cores {requested}: CPUs {a} and {b} are hyper-threads of one "
                        f"physical core; choose one per core (physical cores here: "
                        f"{physical_cores(allowed, root)})"
                    )
    else:
        cores = physical_cores(allowed, root)
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise UsageError(f"-t {threads}: choose 1..{len(cores)} (one thread per physical "
                             f"core of {cores})")
        cores = cores[:threads]
    return cores


def largest_cache_bytes(cpu: int = 0, root: Path = SYS_CPU) -> int:
    """Size in bytes of the largest cache `cpu` sees (its L3 on most x86 machines), from
    /sys/devices/system/cpu/cpuN/cache/index*/size; 0 where none is exposed."""
    sizes = [0]
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for size in (root / f"cpu{cpu}" / "cache").glob("index*/size"):
        text = size.read_text().strip()
        if text[-1:].upper() in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1].upper()])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)
