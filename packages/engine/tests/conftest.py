import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def edge_home(tmp_path_factory) -> Path:
    """One private EDGE_INFER_HOME for the test session: tests never touch the user's cache."""
    home = tmp_path_factory.mktemp("edge-home")
    old = os.environ.get("EDGE_INFER_HOME")
    os.environ["EDGE_INFER_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("EDGE_INFER_HOME", None)
    else:
        os.environ["EDGE_INFER_HOME"] = old


@pytest.fixture(scope="session")
def smollm2(edge_home):
    """The embedded default model, pulled once per test session through the real CLI path."""
    from edge_infer.models.pull import pull

    return pull("smollm2-135m")


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_infer", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
