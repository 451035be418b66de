"""The contention guard against real load: the load generator's processes, bounded in time."""

import os
import re
import subprocess
import sys
import time

import pytest
from harness_cli import cli

from edge_harness.isolation.load import LoadGenerator
from edge_harness.record import read_records
from edge_infer.api import Guard, GuardRefused, missing_provenance

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
    assert rec.guard == "overridden" and missing_provenance(rec.to_dict()) == []
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


@pytest.mark.parametrize("command", [["bench", "ceiling"], ["bench", "gemm"],
                                     ["bench", "profile"], ["fidelity", "run"]])
def test_a_dirty_tree_may_not_write_into_docs_results(tmp_path, command):
    """Refused in one line before anything is measured, unless --allow-dirty."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git here")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tmp_path)]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    (tmp_path / "f").write_text("b")
    results = tmp_path / "docs" / "results" / "out.jsonl"
    out = cli(*command, "--results", str(results), timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "uncommitted changes" in out.stderr and "--allow-dirty" in out.stderr, out.stderr
    assert not results.exists()


# -- the guard's arithmetic on synthetic counters (no load, no sleeping) ---------------------
from edge_infer.api import Sample  # noqa: E402


def samples(windows, own=None, dt=0.5, cpus=(0, 1)):
    """Cumulative counters, as /proc/stat gives them, from per-sub-window busy fractions:
    windows[i] = {cpu: fraction of the cpu busy}, own[i] = cores' worth used by the child."""
    t, busy, used = 100.0, dict.fromkeys(cpus, 5000.0), 40.0
    out = [Sample(t, dict(busy), used)]
    for i, w in enumerate(windows):
        t += dt
        for c in cpus:
            busy[c] += w.get(c, 0.0) * dt
        used += (own[i] if own else 0.0) * dt
        out.append(Sample(t, dict(busy), used))
    return out


def no_smt(tmp_path):
    for c in range(4):
        (tmp_path / f"cpu{c}" / "topology").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c}\n")
    return tmp_path


@pytest.mark.parametrize(("engine", "burst"), [
    ({}, {1: 1.0}),  # an idle engine (a sleeper): core 1 taken whole for 0.5 s
    ({0: 0.8, 1: 0.8}, {1: 1.0}),  # an engine at 0.8 per core; the burst takes the rest of cpu1
], ids=["engine-idle", "engine-busy"])
def test_a_one_core_burst_the_mean_passes_is_refused(tmp_path, engine, burst):
    """10 s on 2 cores, one core busy with something else for one 0.5 s sub-window: the
    mean over the run is 0.01-0.03 of a core, far below 0.15; the worst one core is not."""
    quiet = dict(engine)
    own = sum(engine.values())
    windows = [quiet] * 20
    windows[7] = {**engine, **burst}
    owns = [own] * 20
    owns[7] = own - 0.5 * bool(engine)  # the engine's thread on cpu1 lost half of the window
    guard = Guard([0, 1], threshold=0.15, topology=no_smt(tmp_path))
    reading = guard.reading_during(samples(windows, owns))
    assert reading.foreign <= 0.15 / 5, reading  # the mean alone would have passed
    assert reading.peak > 0.15 and reading.peak_core == 1, reading
    with pytest.raises(GuardRefused, match=r"worst one core cpu1 .* over 0\.5 s"):
        guard.judge(reading, "a test")
    forced = Guard([0, 1], threshold=0.15, force=True, topology=no_smt(tmp_path))
    verdict = forced.verdict().add(forced.judge(reading, "a test"), reading)
    assert verdict.fields()["guard"] == "overridden"
    assert verdict.fields()["guard_peak_load"] == pytest.approx(reading.peak, abs=1e-4)


def test_a_long_run_judges_its_peak_over_one_percent_of_it(tmp_path):
    """400 s of serving: a 0.5 s blip on one core is 0.1% of the run and passes; the same core
    taken for 8 s (2% of the run, so one whole 4 s window wherever the windows fall) is
    refused. The record says over what window."""
    guard = Guard([0, 1], threshold=0.15, topology=no_smt(tmp_path))
    engine = {0: 0.5, 1: 0.5}  # a server waiting on its client half the time
    blip = [engine] * 800
    blip[300] = {0: 0.5, 1: 1.0}  # cpu1's idle half taken by something else for 0.5 s
    reading = guard.reading_during(samples(blip, [1.0] * 800))
    assert reading.peak_seconds == pytest.approx(4.0)
    assert 0.01 < reading.peak < 0.15 and guard.judge(reading, "a test") == "ok"
    verdict = guard.verdict().add("ok", reading)
    assert verdict.fields()["guard_peak_window"] == pytest.approx(4.0)
    taken = [engine] * 800
    for i in range(300, 316):
        taken[i] = {0: 0.5, 1: 1.0}
    reading = guard.reading_during(samples(taken, [1.0] * 800))
    assert reading.peak > 0.15
    with pytest.raises(GuardRefused, match=r"worst one core cpu1 .* over 4\.0 s"):
        guard.judge(reading, "a test")


def test_an_engine_alone_with_uneven_threads_is_not_foreign(tmp_path):
    """The child's own time is not placed on a core by the counters: a main thread at 100%
    beside a worker at 40% must not read as foreign load on the main thread's core."""
    guard = Guard([0, 1], threshold=0.15, topology=no_smt(tmp_path))
    reading = guard.reading_during(samples([{0: 1.0, 1: 0.4}] * 8, [1.4] * 8))
    assert reading.foreign == pytest.approx(0, abs=1e-9)
    assert reading.peak == pytest.approx(0, abs=1e-9)
    assert guard.judge(reading, "a test") == "ok"


def test_a_short_tail_is_joined_to_the_last_sub_window(tmp_path):
    """The last sample is taken when the run ends: 0.05 s of 10 ms ticks would read one
    stray tick as 20% of a core."""
    guard = Guard([0], threshold=0.15, topology=no_smt(tmp_path))
    s = samples([{}] * 4, cpus=(0,))
    tick = Sample(s[-1].t + 0.05, {0: s[-1].busy[0] + 0.01}, s[-1].own)
    reading = guard.reading_during([*s, tick])
    assert reading.peak == pytest.approx(0.01 / 0.55)
    assert guard.judge(reading, "a test") == "ok"


def smt_topology(tmp_path):
    """Two physical cores with two hyper-threads each: cpu0/cpu2 and cpu1/cpu3."""
    for c, sibs in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        (tmp_path / f"cpu{c}" / "topology").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(sibs + "\n")
    return tmp_path


def test_load_on_an_smt_sibling_counts_against_the_pinned_core(tmp_path):
    guard = Guard([0, 1], threshold=0.15, topology=smt_topology(tmp_path))
    assert guard.siblings == {0: [2], 1: [3]} and guard.watched == [0, 1, 2, 3]
    cpus = (0, 1, 2, 3)
    # Before a run: the chosen cores idle, cpu3 (cpu1's sibling) half busy.
    s0, s1 = samples([{3: 0.5}], dt=1.0, cpus=cpus)
    before = guard.reading_before(s0, s1)
    assert before.per_core == {0: 0.0, 1: 0.5} and before.peak_core == 1
    with pytest.raises(GuardRefused, match="with SMT siblings 2,3"):
        guard.judge(before, "a test")
    # During a run: the engine busy on cpu0 and cpu1, cpu2 busy for one sub-window.
    windows = [{0: 0.9, 1: 0.9}] * 10
    windows[4] = {0: 0.9, 1: 0.9, 2: 1.0}
    reading = guard.reading_during(samples(windows, [1.8] * 10, cpus=cpus))
    assert reading.foreign <= 0.15 and reading.peak == pytest.approx(1.0)
    assert reading.peak_core == 0
    with pytest.raises(GuardRefused):
        guard.judge(reading, "a test")
    # The same counters without SMT: cpu2 is not watched, nothing is foreign.
    plain = Guard([0, 1], threshold=0.15, topology=no_smt(tmp_path / "plain"))
    assert plain.judge(plain.reading_during(samples(windows, [1.8] * 10, cpus=cpus)), "") == "ok"


def test_a_watch_samples_every_sub_window_and_follows_new_children(test_core):
    """The real counters, no load: a child started inside the watch is part of the tree."""
    guard = Guard([test_core], threshold=1.0, sub_window=0.2)
    with guard.watch(os.getpid()) as watch:
        subprocess.run(["sleep", "0.7"], check=True)
    assert len(watch.samples) >= 4, watch.samples
    assert watch.reading.phase == "during" and watch.reading.peak_core == test_core
    assert watch.reading.peak >= watch.reading.foreign - 1e-9


# -- every record kind carries the verdict ----------------------------------------------------
VERDICT_FIELDS = ("guard", "guard_foreign_load", "guard_mean_load", "guard_peak_load",
                  "guard_threshold", "guard_window", "guard_sub_window", "guard_remeasured")


def test_a_repetition_run_beside_a_blip_is_thrown_away_and_taken_again(tmp_path):
    """A shared machine's blip costs one repetition, not the run: the contended tg sample is
    dropped (never published as ok), taken again, and the record counts it; past REMEASURE
    contended takes the guard refuses as before."""
    import contextlib
    from types import SimpleNamespace

    from edge_harness.bench import run as run_mod
    from edge_harness.runners.base import Build, ModelRef
    from edge_infer.api import REMEASURE

    topo = no_smt(tmp_path / "topo")
    quiet = samples([{0: 0.5}] * 3, [0.5] * 3, cpus=(0,))
    blip = samples([{0: 0.5}, {0: 1.0}, {0: 0.5}], [0.5] * 3, cpus=(0,))

    class ScriptedGuard(Guard):
        def __init__(self, script):
            super().__init__([0], threshold=0.15, topology=topo)
            self.script = list(script)

        def check_idle(self, what):
            s0, s1 = samples([{0: 0.0}], cpus=(0,))
            return "ok", self.reading_before(s0, s1)

        @contextlib.contextmanager
        def watch(self, pid):
            yield SimpleNamespace(reading=self.reading_during(self.script.pop(0)))

    class Engine:  # each take of tg4 is slower than the one before: 4 / 1, 4 / 2, ...
        pid, calls = os.getpid(), 0

        def request(self, cmd, **kw):
            self.calls += 1
            return {"seconds": float(self.calls)}

    model = ModelRef("fake", tmp_path)
    build = Build("ours", "fake", "w4a16", str(tmp_path), 4.5, 1000, 100)

    def run(script):
        bench = run_mod.Bench(run_mod.Plan(models=[], engines=[], results=None, reps=2))
        engine = Engine()
        bench.measure_test(model, [(build, engine)], "tg", 4, [0], 1, ScriptedGuard(script),
                           None, {build.label: {"version": "fake 1"}}, run_mod.Progress(2))
        return bench.records[0].to_dict()

    # take 1 is the untimed warm-up; take 2 ran beside the blip and is thrown away
    rec = run([blip, quiet, quiet])
    assert rec["samples"] == [4 / 3, 4 / 4] and rec["guard"] == "ok"
    assert rec["guard_remeasured"] == 1 and rec["guard_peak_load"] < 0.15
    assert run([quiet, quiet])["guard_remeasured"] == 0
    with pytest.raises(GuardRefused, match="tg4 of fake"):
        run([blip] * (REMEASURE + 1) + [quiet])


def test_every_record_kind_carries_the_guard_verdict(tmp_path, monkeypatch):
    """pp/tg, ceiling, parallel_region, dot_peak, gemm and profile records: each says what the guard saw
    while it was timed (engines, children and the clock faked: nothing is measured)."""
    import contextlib
    from types import SimpleNamespace

    import edge_harness.isolation.child as child_mod
    import edge_infer.api as guard_mod
    from edge_harness.bench import batched, gemm, profile
    from edge_harness.bench import ceiling as ceiling_mod
    from edge_harness.bench import run as run_mod
    from edge_harness.runners.base import Build, ModelRef

    topo = no_smt(tmp_path / "topo")
    watched = []

    class FakeGuard(Guard):
        def __init__(self, cores, *args, **kw):
            super().__init__(cores, *args, **{**kw, "topology": topo})

        def check_idle(self, what):
            s0, s1 = samples([{0: 0.02}], cpus=tuple(self.cores))
            return "ok", self.reading_before(s0, s1)

        @contextlib.contextmanager
        def watch(self, pid):
            watched.append(pid)
            yield SimpleNamespace(reading=self.reading_during(
                samples([{0: 0.5}, {0: 0.6}, {0: 0.5}], [0.5, 0.5, 0.5], cpus=tuple(self.cores))))

    row = {"m": 1, "n": 64, "k": 64, "layer": "qkv_proj", "group": 128, "weight_bytes": 2048,
           "copies": 1, "timing": "op", "impl": "nib128", "quant": "w4a16", "seconds": [1e-4, 1e-4]}
    replies = {"load": {"facts": {"version": "fake 1"}}, "tg": {"seconds": 0.5},
               "profile": {"result": {"decode_s": 0.2, "in_ops_s": 0.1, "wall_s": 0.2,
                                      "tokens": 4, "ops": []}},
               "on_runner": {"result": {"seconds": 0.4, "extra": None}}}

    class FakeWorker:
        pid = os.getpid()

        def __init__(self, *a, **kw):
            pass

        def request(self, cmd, **kw):
            if cmd == "call":
                fn = kw["fn"]
                if fn.endswith(":dot_peaks"):
                    return {"result": {"vpdpbusd zmm (int8, AVX512-VNNI)": [100.0, 110.0]}}
                return {"result": [row] if fn.endswith(":measure") else [1.0, 1.2]}
            return replies[cmd]

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    model = ModelRef("fake", tmp_path)
    build = Build("ours", "fake", "w4a16", str(tmp_path), 4.5, 1000, 100)
    monkeypatch.setattr(guard_mod, "Guard", FakeGuard)
    monkeypatch.setattr(child_mod, "Worker", FakeWorker)
    monkeypatch.setattr(profile, "Worker", FakeWorker)
    monkeypatch.setattr(profile, "bench_lock", lambda wait: contextlib.nullcontext())
    monkeypatch.setattr(profile, "context", lambda threads: {})
    monkeypatch.setattr(profile, "get_runner", lambda name: SimpleNamespace(
        profiler=True, accepts=lambda q: True, prepare=lambda m, q: build, child_env=lambda *a: {}))
    monkeypatch.setattr(profile, "locate", lambda runner: "ours")
    monkeypatch.setattr(batched, "Worker", FakeWorker)
    monkeypatch.setattr(batched, "locate", lambda runner: "ours")
    monkeypatch.setattr(batched, "get_runner", lambda name: SimpleNamespace(
        batched=True, prepare=lambda m, q: build, child_env=lambda *a: {}))
    monkeypatch.setattr(run_mod, "resolve_model", lambda name: model)
    monkeypatch.setattr(ceiling_mod, "measure", lambda cores, gib=1.0, passes=5: {
        "samples_gbs": [10.0, 11.0], "ceiling_gbs": 11.0})
    monkeypatch.setattr("edge_infer.profiles.load", lambda name: SimpleNamespace(
        quant=SimpleNamespace(group_size=128)))

    bench = run_mod.Bench(run_mod.Plan(models=[], engines=[], results=None, reps=2))
    guard = FakeGuard([0], threshold=0.15)
    bench.ceiling(guard)
    bench.measure_test(model, [(build, FakeWorker())], "tg", 4, [0], 1, guard, 11.0,
                       {build.label: {"version": "fake 1"}}, run_mod.Progress(2))
    gemm.run(["fake"], [0], guard=guard, emit=bench.emit, record=bench.record, say=lambda s: None)
    prof = profile.run("fake", "ours", "w4a16", 4, "0", None, None, "test", 0.0,
                       say=lambda s: None, guard={"threshold": 0.15})
    batched.run("fake", [run_mod.EngineSpec("ours", "w4a16", ())], [1], 4, 2, [0], guard=guard,
                emit=bench.emit, record=bench.record, say=lambda s: None)
    kinds = {r.test: r.to_dict() for r in bench.records} | {"profile": prof}
    assert set(kinds) == {"ceiling", "tg4", "parallel_region", "dot_peak", "gemm_m1_qkv_proj",
                          "profile", "batched_b1_tg4"}
    assert kinds["batched_b1_tg4"]["samples"] == [100.0, 100.0]  # 0.4 s / 4 steps, in ms
    for kind, rec in kinds.items():
        missing = [f for f in VERDICT_FIELDS if rec.get(f) is None]
        assert not missing, (kind, missing)
        assert rec["guard"] == "ok" and rec["guard_threshold"] == 0.15, (kind, rec)
        # the watch's worst sub-window (0.6 busy, 0.5 own), not only the before-check
        assert rec["guard_peak_load"] == pytest.approx(0.1, abs=1e-3), kind
    # every kind was watched while it was timed, not only checked before
    # (the ceiling, two reps of tg, the parallel region, the dot peaks, gemm, the profile,
    # two reps of batched decode)
    assert len(watched) == 1 + 2 + 1 + 1 + 1 + 1 + 2, watched


def test_a_run_too_short_for_the_counters_is_judged_with_their_resolution():
    """A 0.1 s tg8 reads 10 ticks per core: 2 ticks of counter skew (0.2 of a core) is not
    load. The same foreign fraction over a 10 s run, or over a 0.5 s sub-window, is refused."""
    from edge_infer.api import Guard, Reading, tick_slack

    guard = Guard([0], threshold=0.15)
    short = Reading("during", 0.1, {0: 1.08}, 0.9, 0.18, 0.18)
    assert tick_slack(0.1) == pytest.approx(0.2) and guard.quiet(short)
    assert not guard.quiet(Reading("during", 10.0, {0: 1.08}, 0.9, 0.18, 0.18, peak_seconds=10.0))
    burst = Reading("during", 10.0, {0: 1.0}, 0.9, 0.05, 0.6, peak_core=0, peak_seconds=0.5)
    assert not guard.quiet(burst)


def test_an_observed_job_blamed_on_load_before_it_says_so(test_core, capsys):
    """A job observed (not refused) after a busy spell: the verdict is contended, and the
    warning names the reading that was contended (before it), not a quiet one during it."""
    guard = Guard([test_core], threshold=0.15, window=1.0)
    observed = guard.observe("a test job")
    with LoadGenerator([test_core], LOAD_SECONDS) as gen:
        wait_busy(gen.pids)
        verdict = observed.__enter__()  # the before-reading is taken under load
    time.sleep(0.5)  # the job itself then runs after the load generator has stopped
    observed.__exit__(None, None, None)
    assert verdict.status == "contended"
    out = capsys.readouterr().out
    assert "before it:" in out and f"cpu{test_core}" in out, out


def test_the_guard_on_allowed_cores_watches_this_process_affinity():
    assert Guard.on_allowed_cores(threshold=0.3).cores == sorted(os.sched_getaffinity(0))


def test_a_watch_of_several_roots_counts_each_tree_as_its_own(test_core):
    """A job that drives processes outside its own tree (containers) names each root: the load
    of any of them is the job's own, not foreign."""
    sleeper = subprocess.Popen(["sleep", "10"])
    try:
        guard = Guard([test_core], threshold=0.5, window=0.5)
        with LoadGenerator([test_core], 3) as gen:
            wait_busy(gen.pids)
            with guard.watch([sleeper.pid, gen.pids[0]]) as watch:
                time.sleep(1.5)
        r = watch.reading
        assert r.own > 0.3, r
        assert r.foreign < r.per_core[test_core] - 0.25, r
    finally:
        sleeper.kill()
        sleeper.wait()
