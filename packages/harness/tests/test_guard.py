"""The contention guard against real load: the load generator's processes, bounded in time."""

import os
import re
import subprocess
import sys
import time

import pytest
from harness_cli import cli

from edge_harness.isolation.guard import Guard, GuardRefused
from edge_harness.isolation.load import LoadGenerator
from edge_harness.record import read_records

LOAD_SECONDS = 20  # every load generator here stops by itself after this


def wait_busy(pids, seconds=5.0):
    import psutil

    procs = [psutil.Process(p) for p in pids]
    for p in procs:
        p.cpu_percent(None)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if all(p.cpu_percent(None) > 50 for p in procs):
            return
    pytest.fail("load generator did not get busy")


def test_guard_refuses_before_a_run_under_load(test_core):
    with LoadGenerator([test_core], LOAD_SECONDS) as gen:
        wait_busy(gen.pids)
        guard = Guard([test_core], threshold=0.15, window=1.0)
        with pytest.raises(GuardRefused) as exc:
            guard.check_idle("a test")
    msg = str(exc.value)
    assert f"pid {gen.pids[0]}" in msg  # names the busy process
    assert "--force" in msg


def test_guard_refuses_during_a_run_under_load(test_core):
    # The "engine" is a pinned sleeper: all load on its core during the watch is foreign.
    sleeper = subprocess.Popen(["sleep", "4"], preexec_fn=lambda: os.sched_setaffinity(0, {test_core}))
    try:
        guard = Guard([test_core], threshold=0.15, window=0.5)
        with LoadGenerator([test_core], LOAD_SECONDS) as gen:
            wait_busy(gen.pids)
            with guard.watch(sleeper.pid) as watch:
                time.sleep(2.0)
        reading = watch.reading
        assert reading.foreign > 0.5, reading
        with pytest.raises(GuardRefused, match=f"pid {gen.pids[0]}"):
            guard.judge(reading, "a test")
        forced = Guard([test_core], threshold=0.15, force=True)
        assert forced.judge(reading, "a test") == "overridden"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_own_load_is_not_foreign(test_core):
    """The measured child's own CPU time is subtracted: a busy engine alone passes."""
    guard = Guard([test_core], threshold=0.5, window=0.5)
    with LoadGenerator([test_core], 3) as gen:
        wait_busy(gen.pids)
        with guard.watch(gen.pids[0]) as watch:  # the load *is* the measured process
            time.sleep(1.5)
    r = watch.reading
    busy = r.per_core[test_core]
    # Whatever else the machine does, the measured process's own time is subtracted from the
    # core's busy time rather than counted as foreign.
    assert r.own > 0.3, r
    assert r.foreign == pytest.approx(max(0.0, busy - r.own), abs=0.05), r
    assert r.foreign < busy - 0.25, r


def test_cli_run_refuses_under_the_load_generator(tmp_path, test_core, edge_home):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    load = subprocess.Popen(
        [sys.executable, "-m", "edge_infer", "bench", "load", "--cores", str(test_core),
         "--seconds", str(LOAD_SECONDS)], stderr=subprocess.PIPE, text=True)
    try:
        line = load.stderr.readline()
        pids = [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]
        wait_busy(pids)
        t0 = time.monotonic()
        res = cli("bench", "run", "-m", str(tmp_path / "m"), "-e", "llama.cpp:q4_0",
                  "--cores", str(test_core), "--no-results", timeout=300)
        assert res.returncode == 3, res.stderr
        assert "contention guard" in res.stderr
        assert f"pid {pids[0]}" in res.stderr
        assert time.monotonic() - t0 < LOAD_SECONDS + 60
    finally:
        load.terminate()  # SIGTERM: it stops its busy processes before it exits
        load.wait(30)


def test_a_killed_load_generator_leaves_no_busy_process(test_core):
    """SIGKILL gives `bench load` no chance to clean up: its busy processes must still die with
    it, or they would load the core for the next test or benchmark."""
    import psutil

    load = subprocess.Popen(
        [sys.executable, "-m", "edge_infer", "bench", "load", "--cores", str(test_core),
         "--seconds", str(LOAD_SECONDS)], stderr=subprocess.PIPE, text=True)
    line = load.stderr.readline()
    pids = [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]
    wait_busy(pids)
    load.kill()
    load.wait()

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.1)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:
        os.kill(p, 9)
    assert not survivors, f"busy processes outlived the killed load generator: {survivors}"


def test_force_records_guard_overridden(tmp_path, test_core, edge_home):
    results = tmp_path / "r.jsonl"
    with LoadGenerator([test_core], LOAD_SECONDS) as gen:
        wait_busy(gen.pids)
        res = cli("bench", "ceiling", "--cores", str(test_core), "--force", "--gib", "0.1",
                  "--passes", "2", "--results", str(results), timeout=300)
    assert res.returncode == 0, res.stderr
    (rec,) = read_records(results)
    assert rec.test == "ceiling" and rec.unit == "GB/s" and rec.cores == [test_core]
    assert rec.guard == "overridden"
    assert rec.guard_foreign_load > 0.5
    assert len(rec.samples) == 2 and all(s > 0 for s in rec.samples)


def test_load_generator_is_bounded_in_time(test_core):
    t0 = time.monotonic()
    res = cli("bench", "load", "--cores", str(test_core), "--seconds", "1.5", timeout=60)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "9"])
def test_threshold_outside_a_fraction_of_a_core_is_refused(value):
    """--threshold 9 would let every run through the guard: only (0, 1] is accepted."""
    out = cli("bench", "run", "-m", "qwen3-0.6b-random", "-e", "ours:w4a16", "--threshold", value)
    assert out.returncode == 2 and "choose a fraction of one core in (0, 1]" in out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "load", "--cores", "x", "--seconds", "1"], "--cores 'x': expected CPU ids"),
    (["bench", "load", "--cores", "0", "--seconds", "0"], "--seconds: must be greater than 0"),
    (["bench", "run", "-m", "smollm2-135m", "-e", "ours:w4a16", "--window", "-1"],
     "--window: must be greater than 0"),
    (["bench", "run", "-m", "smollm2-135m", "-e", "ours:w4a16", "--wait", "soon"],
     "--wait: expected a number of seconds"),
    (["bench", "run", "-m", "smollm2-135m", "-e", ":q4_0"], "expected ENGINE:QUANT"),
    (["bench", "profile", "-e", "ours:w4a16", "--lock-wait", "-5"], "--lock-wait: must be 0 or more"),
], ids=["cores", "seconds", "window", "wait", "engine-spec", "lock-wait"])
def test_bad_bench_input_is_a_one_line_error(args, message):
    """A typo on the command line is the usage line and one error line, never a traceback."""
    out = cli(*args, timeout=120)
    assert out.returncode in (1, 2), out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len([line for line in out.stderr.splitlines() if "error" in line]) == 1
