"""The pinned child: `python -m edge_harness.isolation.worker` (started by isolation.child).

It reports the affinity it was born with before importing anything heavy, then serves
requests, each through the handler HANDLERS names for its `cmd`: load an engine build, time pp
/ tg, profile, or call any function, given the loaded runner (`on_runner`: fidelity's work,
edge_harness.fidelity.score) or not (`call`: GEMM microbenchmark, tests). This file knows the
runner protocol only (runners.base), never what a caller does with it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def task_affinities() -> dict[int, list[int]]:
    """Affinity of every thread of this process (engines bind their own threads)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = sorted(os.sched_getaffinity(int(task.name)))
        except OSError:
            pass
    return out


class Child:
    """What requests share: the affinity the child was born with and the loaded runner."""

    def __init__(self, born_with: list[int]):
        self.born_with = born_with
        self.runner: Any = None


Handler = Callable[[Child, dict], dict]
HANDLERS: dict[str, Handler] = {}


def handler(cmd: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[cmd] = fn
        return fn
    return register


def _function(ref: str) -> Callable:
    module, fn = ref.split(":")
    return getattr(importlib.import_module(module), fn)


def _loaded(child: Child) -> Any:
    if child.runner is None:
        raise ValueError("no build is loaded: send `load` first")
    return child.runner


@handler("affinity")
def _affinity(child: Child, req: dict) -> dict:
    return {"affinity": sorted(os.sched_getaffinity(0)), "tasks": task_affinities(),
            "born_with": child.born_with}


@handler("load")
def _load(child: Child, req: dict) -> dict:
    from edge_harness.runners import get_runner
    from edge_harness.runners.base import Build

    child.runner = get_runner(req["engine"])()
    facts = child.runner.load(Build.from_dict(req["build"]), req["threads"], req["n_ctx"])
    facts["cores"] = child.born_with
    facts["thread_cores"] = sorted({c for cs in task_affinities().values() for c in cs})
    return {"facts": facts}


@handler("pp")
@handler("tg")
def _time(child: Child, req: dict) -> dict:
    runner = _loaded(child)
    seconds = getattr(runner, req["cmd"])(req["n"], req["seed"])
    return {"seconds": seconds, "wall": getattr(runner, "last_wall", None),
            "extra": getattr(runner, "last_extra", None)}


@handler("profile")  # per-op split of decode steps on the loaded build
def _profile(child: Child, req: dict) -> dict:
    runner = _loaded(child)
    if not runner.profiler:
        raise ValueError(f"engine {runner.name} has no op profiler")
    return {"result": runner.profile(req["n"], req["seed"], batch=req.get("batch", 1))}


@handler("on_runner")  # fn(runner, **kwargs) on the loaded build (fidelity's log-probs, greedy)
def _on_runner(child: Child, req: dict) -> dict:
    return {"result": _function(req["fn"])(_loaded(child), **req["kwargs"])}


@handler("call")
def _call(child: Child, req: dict) -> dict:
    return {"result": _function(req["fn"])(**req["kwargs"])}


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything an engine prints goes to the log, not into the protocol
    child = Child(sorted(os.sched_getaffinity(0)))

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    send({"ok": True, "pid": os.getpid(), "affinity": child.born_with})
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        try:
            fn = HANDLERS.get(req["cmd"])
            if fn is None:
                raise ValueError(f"unknown command {req['cmd']!r}; known: {', '.join(HANDLERS)}")
            send({"ok": True, **fn(child, req)})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()})
    if child.runner is not None:
        child.runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
