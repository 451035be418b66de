"""Refuse a misconfigured comparison: engines compared must run on the same cores, with the
same thread count and the same prefix-caching setting (the contention guard itself is
edge_infer.api.Guard)."""

from __future__ import annotations

from edge_infer.api import EdgeInferError


class ComparisonRefused(EdgeInferError):
    """Engines of one comparison differ in cores, threads or prefix caching (exit code 4)."""

    exit_code = 4


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
