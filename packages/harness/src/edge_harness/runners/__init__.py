"""Engine adapters: one file per engine, each setting `RUNNER`; found by scanning this folder."""

from __future__ import annotations

import importlib
import pkgutil

from edge_harness.runners.base import missing
from edge_infer.api import UsageError

_ELSEWHERE: dict[str, type] = {}  # adapters loaded as package.module:Class, by their name


def runners() -> dict[str, type]:
    """Engine name -> adapter class, for every module here that defines RUNNER."""
    found = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        cls = getattr(module, "RUNNER", None)
        if cls is not None:
            found[cls.name] = cls
    return found


def get_runner(engine: str) -> type:
    """An engine by name, or any adapter class as `package.module:Class` (after which its name
    finds it too, in this process), checked against the protocol it declares (runners.base)."""
    if ":" in engine:
        module, attr = engine.split(":", 1)
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"engine {engine!r}: cannot import it ({exc})") from None
        _ELSEWHERE[cls.name] = cls
    else:
        known = runners() | _ELSEWHERE
        try:
            cls = known[engine]
        except KeyError:
            raise UsageError(f"unknown engine {engine!r}; known: {', '.join(sorted(known))}") from None
    lacks = missing(cls)
    if lacks:
        raise UsageError(f"engine {engine!r} ({cls.__module__}.{cls.__qualname__}) lacks "
                         f"{', '.join(lacks)}: see the protocols in edge_harness/runners/base.py")
    return cls


def locate(cls: type) -> str:
    """What get_runner resolves to `cls` in any process (the pinned child): the engine's name
    for the adapters in this folder, package.module:Class for one from elsewhere."""
    if runners().get(cls.name) is cls:
        return cls.name
    return f"{cls.__module__}:{cls.__qualname__}"
