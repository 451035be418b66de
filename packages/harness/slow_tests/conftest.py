"""Slow tests (a build of llama.cpp's tools): run by `nox -s fidelity-crosscheck`, which CI runs."""

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def cli():
    """`python -m edge_infer ARGS` in the user's EDGE_INFER_HOME, unbuffered, output captured."""

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edge_infer", *args], capture_output=True,
                              text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})

    return run


@pytest.fixture(scope="session")
def smollm2(cli) -> str:
    """smollm2-135m pulled (once) through the CLI; its registry name."""
    pull = cli("models", "pull", "smollm2-135m", timeout=1800)
    assert pull.returncode == 0, pull.stderr[-2000:]
    return "smollm2-135m"
