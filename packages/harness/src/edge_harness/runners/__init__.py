"""Engine adapters: one file per engine, each setting `RUNNER`; found by scanning this folder."""

from __future__ import annotations

import importlib
import pkgutil

from edge_infer.api import UsageError


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
    """An engine by name, or any adapter class as `package.module:Class`."""
    if ":" in engine and "." in engine.split(":", 1)[0]:
        module, attr = engine.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    known = runners()
    try:
        return known[engine]
    except KeyError:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(sorted(known))}") from None
