"""Every build, test and benchmark of edge-infer is a nox session: `nox -l` lists them.

Environments are synced from uv.lock (`uv sync --frozen`), so a session installs exactly the
pinned versions; the CPU torch wheel comes from ./wheels (tools/torch_wheel.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]

PACKAGES = {"engine": "edge-infer", "harness": "edge-infer-harness", "export": "edge-infer-export"}
# Offline by construction: no model hub is ever reached, vLLM reports nothing home.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def sync(session: nox.Session, *packages: str, extras: tuple[str, ...] = ()) -> None:
    """Install the locked dependencies of `packages` (plus the test tools) into the session."""
    session.run_install(sys.executable, str(ROOT / "tools" / "torch_wheel.py"), silent=True)
    args = ["uv", "sync", "--frozen", "--inexact", "--group", "dev"]
    for pkg in packages:
        args += ["--package", pkg]
    for extra in extras:
        args += ["--extra", extra]
    session.run_install(
        *args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}, external=True
    )


def pytest(session: nox.Session, *paths: str) -> None:
    session.run(
        "pytest", *paths, *session.posargs,
        env={**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
    )


@nox.session(name="tests-engine", tags=["test"])
def tests_engine(session: nox.Session) -> None:
    """Engine package alone: CLI, reference models, vLLM plugin."""
    sync(session, "edge-infer", extras=("vllm",))
    pytest(session, "packages/engine/tests")


@nox.session(name="tests-harness", tags=["test"])
def tests_harness(session: nox.Session) -> None:
    """Harness package (with the engine and llama.cpp it measures)."""
    sync(session, "edge-infer-harness")
    pytest(session, "packages/harness/tests")


@nox.session(name="tests-export", tags=["test"])
def tests_export(session: nox.Session) -> None:
    """Export package alone (engine core, ExecuTorch, QNN quantizer, AI Hub client)."""
    sync(session, "edge-infer-export")
    pytest(session, "packages/export/tests")


@nox.session(tags=["test"])
def tests(session: nox.Session) -> None:
    """All tests: lint, then each package in its own environment."""
    session.notify("lint")
    for short in PACKAGES:
        session.notify(f"tests-{short}")


@nox.session(tags=["test"])
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; uv.lock must match the pyprojects."""
    session.run("uv", "lock", "--check", external=True)
    session.install("ruff==0.14.10")
    session.run("ruff", "check", ".")


@nox.session
def serve(session: nox.Session) -> None:
    """Set up the engine and serve the embedded default model (args go to `edge-infer serve`)."""
    sync(session, "edge-infer", extras=("vllm",))
    session.run("edge-infer", "serve", *session.posargs, env=OFFLINE_ENV)


@nox.session
def models(session: nox.Session) -> None:
    """`edge-infer models ...` in the engine environment, e.g. `nox -s models -- pull NAME`."""
    sync(session, "edge-infer")
    session.run("edge-infer", "models", *(session.posargs or ["list"]), env=OFFLINE_ENV)


if os.environ.get("CI"):
    nox.options.error_on_missing_interpreters = True
