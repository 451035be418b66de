"""The serve smoke's cold-start timing runs under the contention guard, and its record says so."""

import contextlib
import json
import os
from types import SimpleNamespace

import pytest

from edge_infer.guard import REMEASURE, Guard, GuardRefused, Sample
from edge_infer.serve import smoke


class ScriptedGuard(Guard):
    """The real guard's judgement over scripted counters: quiet before each start, and
    `foreign` cores' worth of someone else's load during it (the start itself uses 1 core)."""

    def __init__(self, foreign: float, **kw):
        super().__init__([0], topology=kw.pop("topology"), **kw)
        self.foreign = foreign
        self.watched: list[int] = []

    def check_idle(self, what):
        return "ok", self.reading_before(Sample(0.0, {0: 0.0}), Sample(1.0, {0: 0.01}))

    @contextlib.contextmanager
    def watch(self, pid):
        self.watched.append(pid)
        yield SimpleNamespace(reading=self.reading_during(
            [Sample(0.0, {0: 0.0}, 0.0), Sample(1.0, {0: 1.0 + self.foreign}, 1.0)]))


@pytest.fixture
def no_build(monkeypatch, tmp_path):
    monkeypatch.setattr(smoke.profiles, "load",
                        lambda name: SimpleNamespace(quant=SimpleNamespace(group_size=64)))
    monkeypatch.setattr(smoke, "default_build", lambda *a: None)
    starts = []
    monkeypatch.setattr(smoke, "one_cold_start",
                        lambda extra, tokens, timeout: starts.append(tokens) or (12.5, 20.0))
    topo = tmp_path / "topo" / "cpu0" / "topology"
    topo.mkdir(parents=True)
    (topo / "thread_siblings_list").write_text("0\n")
    return starts, tmp_path / "topo"


def test_a_cold_start_record_carries_the_guard_verdict(tmp_path, no_build):
    starts, topo = no_build
    guard = ScriptedGuard(0.0, topology=topo)
    out = tmp_path / "engine.jsonl"
    rec = smoke.run_cold_start(out, 3, 8, "eager", 60.0, guard)
    assert starts == [8, 8, 8] and guard.watched == [os.getpid()] * 3  # each start watched
    written = json.loads(out.read_text())
    assert written == rec
    for field in ("guard", "guard_mean_load", "guard_peak_load", "guard_threshold",
                  "guard_window", "guard_sub_window", "guard_peak_window", "guard_remeasured"):
        assert rec[field] is not None, field
    assert rec["guard"] == "ok" and rec["guard_threshold"] == guard.threshold
    assert rec["cores"] == [0] and rec["first_token_s"]["median"] == 12.5


def test_a_cold_start_beside_foreign_load_is_retaken_then_refused(tmp_path, no_build):
    starts, topo = no_build
    guard = ScriptedGuard(0.5, topology=topo)
    with pytest.raises(GuardRefused, match="serve cold start eager 1/2"):
        smoke.run_cold_start(tmp_path / "engine.jsonl", 2, 8, "eager", 60.0, guard)
    assert len(starts) == 1 + REMEASURE  # thrown away REMEASURE times, then refused
    assert not (tmp_path / "engine.jsonl").exists()  # nothing published


def test_forced_cold_starts_are_recorded_as_overridden(tmp_path, no_build):
    _, topo = no_build
    guard = ScriptedGuard(0.5, topology=topo, force=True)
    rec = smoke.run_cold_start(tmp_path / "engine.jsonl", 2, 8, "eager", 60.0, guard)
    assert rec["guard"] == "overridden" and rec["guard_mean_load"] == pytest.approx(0.5)
