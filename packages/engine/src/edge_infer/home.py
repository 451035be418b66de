"""Where edge-infer keeps what it builds: models, checkpoints, compile caches."""

import os
from pathlib import Path


def home() -> Path:
    """`EDGE_INFER_HOME`, else `$XDG_CACHE_HOME/edge-infer`, else `~/.cache/edge-infer`."""
    if env := os.environ.get("EDGE_INFER_HOME"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "edge-infer"


def models_dir() -> Path:
    return home() / "models"
