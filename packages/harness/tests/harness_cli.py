"""The `edge-infer` CLI as a subprocess, for tests (a module, not conftest: no name clashes)."""

import subprocess
import sys


def cli(*args: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_infer", *args], capture_output=True,
                          text=True, timeout=timeout, **kw)
