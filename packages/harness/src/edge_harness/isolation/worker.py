"""The pinned child: `python -m edge_harness.isolation.worker` (started by isolation.child).

It reports the affinity it was born with before importing anything heavy, then serves
requests: load an engine build, time pp / tg, or call a function (GEMM microbenchmark, tests).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def task_affinities() -> dict[int, list[int]]:
    """Affinity of every thread of this process (engines bind their own threads)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = sorted(os.sched_getaffinity(int(task.name)))
        except OSError:
            pass
    return out


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything an engine prints goes to the log, not into the protocol
    born_with = sorted(os.sched_getaffinity(0))

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    send({"ok": True, "pid": os.getpid(), "affinity": born_with})
    runner = None
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "quit":
            break
        try:
            if cmd == "affinity":
                reply = {"affinity": sorted(os.sched_getaffinity(0)),
                         "tasks": task_affinities(), "born_with": born_with}
            elif cmd == "load":
                from edge_harness.runners import get_runner
                from edge_harness.runners.base import Build

                runner = get_runner(req["engine"])()
                facts = runner.load(Build.from_dict(req["build"]), req["threads"], req["n_ctx"])
                tasks = task_affinities()
                facts["cores"] = born_with
                facts["thread_cores"] = sorted({c for cs in tasks.values() for c in cs})
                reply = {"facts": facts}
            elif cmd in ("pp", "tg"):
                seconds = getattr(runner, cmd)(req["n"], req["seed"])
                reply = {"seconds": seconds, "wall": getattr(runner, "last_wall", None),
                         "extra": getattr(runner, "last_extra", None)}
            elif cmd == "profile":  # per-op split of decode steps on the loaded build
                if not hasattr(runner, "profile"):
                    raise ValueError(f"engine {req.get('engine', '?')} has no op profiler")
                reply = {"result": runner.profile(req["n"], req["seed"], batch=req.get("batch", 1))}
            elif cmd == "fidelity":  # logits / greedy work on the loaded build
                from edge_harness.fidelity import score
                reply = {"result": score.in_child(runner, **req)}
            elif cmd == "call":
                module, fn = req["fn"].split(":")
                reply = {"result": getattr(importlib.import_module(module), fn)(**req["kwargs"])}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            send({"ok": True, **reply})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()})
    if runner is not None:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
