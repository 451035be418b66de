"""The sandbox model-written code runs in (edge_harness.tasks.sandbox): what must fail fails and
is contained; a correct program passes. Each containment test names the layer it checks and is
skipped, with the reason, where this machine does not give that layer."""

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from edge_harness.tasks import sandbox
from edge_harness.tasks.sandbox import Limits

ISO = sandbox.isolation()
# The OS layers alone (no audit hook): only where we drop to `nobody` inside namespaces.
OS_LAYERS = pytest.mark.skipif(
    ISO.user != sandbox.UNPRIVILEGED or not ISO.pid_namespace,
    reason=f"the OS layers need root, unshare and a Python {sandbox.UNPRIVILEGED} may run; "
    f"here: user {ISO.user}, missing {list(ISO.missing)}")
BOTH = pytest.mark.parametrize("guard", [True, pytest.param(False, marks=OS_LAYERS)],
                               ids=["hook+os", "os-only"])
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the drop to nobody happens only as root")

ADD = "def add(a, b):\n    return a + b\n"


def leftovers() -> list[str]:
    """Sandboxed processes still alive (their command line names our runner)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"runner.py" in cmdline.read_bytes():
                out.append(cmdline.parent.name)
        except OSError:
            continue
    return out


def test_correct_program_passes():
    out = sandbox.run(ADD + "assert add(2, 3) == 5\n")
    assert out.passed and out.status == "passed", out


def test_wrong_program_fails():
    out = sandbox.run(ADD.replace("+", "-") + "assert add(2, 3) == 5\n")
    assert not out.passed and out.status == "failed"
    assert "AssertionError" in out.stderr


def test_early_exit_zero_is_not_a_pass():
    out = sandbox.run("import sys\nsys.exit(0)\nassert False\n")
    assert out.returncode == 0 and not out.passed


@BOTH
def test_write_outside_its_directory_is_refused(tmp_path, guard):
    target = tmp_path / "escaped.txt"  # tmp_path: ours, not writable by `nobody`
    out = sandbox.run(f"open({str(target)!r}, 'w').write('x')\n", guard=guard)
    assert not out.passed and not target.exists(), out
    assert "PermissionError" in out.stderr, out.stderr


def test_hook_refuses_writes_to_world_writable_tmp():
    target = Path(tempfile.gettempdir()) / f"edge-escape-{os.getpid()}"
    try:
        out = sandbox.run(f"open({str(target)!r}, 'w').write('x')\n")
        assert not out.passed and not target.exists(), out
        assert "outside the sandbox" in out.stderr
    finally:
        target.unlink(missing_ok=True)


@BOTH
def test_fork_bomb_is_contained(guard):
    started = time.monotonic()
    out = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass\n", Limits(timeout_s=3), guard=guard)
    assert not out.passed
    assert time.monotonic() - started < 3 + 10
    time.sleep(0.5)
    assert leftovers() == []


def test_infinite_loop_times_out():
    started = time.monotonic()
    out = sandbox.run("while True:\n    pass\n", Limits(timeout_s=2))
    assert out.status == "timeout" and not out.passed
    assert 2 <= time.monotonic() - started < 2 + 10
    assert leftovers() == []


@pytest.mark.skipif(not ISO.net_namespace, reason=f"no network namespace here: {list(ISO.missing)}")
def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        out = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n",
                          guard=False)
        assert not out.passed, out
        with pytest.raises(TimeoutError):
            server.accept()


def test_memory_and_file_size_are_limited():
    big = sandbox.run("x = bytearray(4 << 30)\n", guard=False)
    assert not big.passed and "MemoryError" in big.stderr, big
    huge = sandbox.run("open('f', 'wb').write(b'0' * (8 << 20))\n", Limits(file_bytes=1 << 20))
    assert not huge.passed, huge


@ROOT
def test_without_unshare_root_still_drops_to_nobody(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.isolation.cache_clear()
    try:
        iso = sandbox.isolation()
        if iso.user != sandbox.UNPRIVILEGED:
            pytest.skip(f"no Python {sandbox.UNPRIVILEGED} may run here: {list(iso.missing)}")
        assert iso.drop is not None and not iso.net_namespace
        assert any("unshare" in m for m in iso.missing)
        target = tmp_path / "escaped.txt"
        out = sandbox.run(f"import os\nassert os.getuid() == {iso.drop[0]}\n"
                          f"open({str(target)!r}, 'w')\n", guard=False)
        assert "PermissionError" in out.stderr and not target.exists(), out
    finally:
        sandbox.isolation.cache_clear()


def test_isolation_is_reported():
    rec = ISO.record()
    assert set(rec) == {"user", "net_namespace", "pid_namespace", "interpreter", "missing"}
    if os.geteuid() == 0 and not rec["missing"]:
        assert rec["user"] == sandbox.UNPRIVILEGED
