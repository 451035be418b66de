"""The serve smoke's cold-start timing runs under the contention guard, and its record says so."""

import contextlib
import json
import os
from types import SimpleNamespace

import pytest

from edge_infer.guard import REMEASURE, Guard, GuardRefused, Sample
from edge_infer.serve import smoke
from edge_infer.testing import provenance_gaps


class ScriptedGuard(Guard):
    """The real guard's judgement over scripted counters: quiet before each start, and
    `foreign` cores' worth of someone else's load during it (the start itself uses 1 core)."""

    def __init__(self, foreign: float, **kw):
        super().__init__([0], topology=kw.pop("topology"), **kw)
        self.foreign = foreign
        self.watched: list[int] = []

    def sample_idle(self):
        return self.reading_before(Sample(0.0, {0: 0.0}), Sample(1.0, {0: 0.01}))

    def check_idle(self, what):
        return "ok", self.sample_idle()

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
    assert provenance_gaps(rec) == []


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


@pytest.mark.parametrize(("foreign", "status"), [(0.0, "ok"), (0.5, "contended")])
def test_the_greedy_comparison_is_observed_by_the_guard(tmp_path, no_build, monkeypatch,
                                                        foreign, status):
    _, topo = no_build
    monkeypatch.setattr(smoke, "pull", lambda name: SimpleNamespace(hf_dir=tmp_path))
    monkeypatch.setattr(smoke, "vllm_env", lambda prof: {})
    monkeypatch.setattr(smoke, "greedy_outputs",
                        lambda r, n: ([[1, 2, 3]] * len(smoke.GREEDY_PROMPTS), ["edge-avx2"]))
    guard = ScriptedGuard(foreign, topology=topo)
    rec = smoke.run_greedy(tmp_path / "engine.jsonl", 3, guard)
    # not a timing: never retaken or refused, but the record says what ran beside it
    assert guard.watched == [os.getpid()] and rec["guard"] == status
    assert rec["guard_mean_load"] == pytest.approx(foreign, abs=0.02)  # idle reads 0.01
    assert rec["exact_matches"] == len(smoke.GREEDY_PROMPTS)
    assert provenance_gaps(rec) == []


def test_a_refused_smoke_prints_one_line_and_exits_with_its_code(monkeypatch, capsys, tmp_path):
    def refuse(*a):
        raise GuardRefused("contention guard: cores 0 are busy before serve cold start")

    monkeypatch.setattr(smoke, "run_cold_start", refuse)
    monkeypatch.setattr("sys.argv", ["smoke", "--skip-greedy", "--out", str(tmp_path / "e.jsonl")])
    with pytest.raises(SystemExit) as exc:
        smoke.main()
    assert exc.value.code == GuardRefused.exit_code != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contention guard" in err and "Traceback" not in err
