"""The one record module: provenance (was the tree clean?), the durable append, the tolerant read."""

import shutil
import subprocess

import pytest

from edge_infer import results
from edge_infer.errors import UsageError
from edge_infer.results import append, context, git_state, latest, read, require_clean

NO_GIT = pytest.mark.skipif(shutil.which("git") is None,
                            reason="no git here (the engine image ships none)")


def repo(path):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(path)], check=True)
    (path / "f").write_text("a")
    subprocess.run([*git, "-C", str(path), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(path), "commit", "-qm", "x"], check=True)


@NO_GIT
def test_context_records_a_dirty_tree(tmp_path, monkeypatch):
    repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert context()["git_dirty"] is False
    (tmp_path / "f").write_text("b")
    assert context()["git_dirty"] is True


@NO_GIT
def test_a_dirty_tree_may_not_publish_without_allow_dirty(tmp_path, monkeypatch):
    repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    published = tmp_path / "docs" / "results" / "bench.jsonl"
    assert require_clean(published, allow_dirty=False) == published  # clean: fine
    (tmp_path / "f").write_text("b")
    with pytest.raises(UsageError, match="uncommitted changes.*--allow-dirty"):
        require_clean(published, allow_dirty=False)
    assert require_clean(published, allow_dirty=True) == published
    assert require_clean(tmp_path / "scratch.jsonl", allow_dirty=False) is not None  # not docs
    assert require_clean(None, allow_dirty=False) is None


def test_append_and_read_survive_a_torn_last_line(tmp_path, caplog):
    """What a crash mid-write leaves (a last line without its newline) is skipped by read and
    cut by the next append; a bad line anywhere else is an error naming it."""
    path = tmp_path / "docs" / "r.jsonl"
    append(path, {"b": 1, "a": float("nan")})
    whole = path.read_bytes()
    assert whole == b'{"a": NaN, "b": 1}\n'  # keys sorted, NaN as Python writes it (old records)
    path.write_bytes(whole + b'{"a": 2, "b"')
    with caplog.at_level("WARNING"):
        assert [r["b"] for r in read(path)] == [1]
    assert "torn last line" in caplog.text
    append(path, {"b": 3})
    assert [r["b"] for r in read(path, parse=lambda d: d)] == [1, 3]
    path.write_bytes(b"{oops\n" + path.read_bytes())
    with pytest.raises(ValueError, match=r"r.jsonl:1: not a bench record"):
        read(path, what="bench record")


def test_latest_keeps_the_newest_record_per_key_in_first_place():
    recs = [{"k": "a", "v": 1}, {"k": "b", "v": 2}, {"k": "a", "v": 3}]
    assert latest(recs, lambda r: r["k"]) == [{"k": "a", "v": 3}, {"k": "b", "v": 2}]


def test_git_state_outside_git(tmp_path):
    assert git_state(tmp_path) == (None, None)


@NO_GIT
def test_git_state_commit_and_dirty(tmp_path):
    repo(tmp_path)
    commit, dirty = git_state(tmp_path)
    short, _ = git_state(tmp_path, short=True)
    assert len(commit) == 40 and commit.startswith(short) and dirty is False
    # records appended to a results file are output, not a change to what measured them;
    # a generated page beside them is tracked like any file
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "bench.jsonl").write_text("{}\n")
    (results / "bench.md").write_text("page")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tmp_path)]
    subprocess.run([*git, "add", "docs"], check=True)
    subprocess.run([*git, "commit", "-qm", "records"], check=True)
    commit, _ = git_state(tmp_path)
    (results / "bench.jsonl").write_text("{}\n{}\n")
    assert git_state(tmp_path) == (commit, False)
    assert git_state(results) == (commit, False)  # from a subfolder too
    (results / "bench.md").write_text("edited")
    assert git_state(tmp_path) == (commit, True)
    (results / "bench.md").write_text("page")
    (tmp_path / "f").write_text("b")
    assert git_state(tmp_path) == (commit, True)


def test_command_line_names_the_program_not_its_path():
    assert results.command_line(["/some/venv/bin/edge-infer", "bench", "run", "-m", "a b"]) == (
        "edge-infer bench run -m 'a b'")


def test_missing_provenance_names_each_absent_field():
    full = {"machine": {"cpu_model": "x", "cpu_flags": [], "threads": 2}, "versions": {},
            "git_commit": "abc", "git_dirty": False, "cores": [0, 1], "guard": "ok",
            "guard_threshold": 0.15, "guard_window": 1.0, "guard_mean_load": 0.0,
            "guard_peak_load": 0.0, "command": "edge-infer x"}
    assert results.missing_provenance(full) == []
    flat = {k: v for k, v in full.items() if k not in ("machine", "versions")}
    flat |= {"cpu_model": "x", "cpu_flags": [], "threads": 2, "engine_version": "1"}
    assert results.missing_provenance(flat) == []  # a harness Record's flat shape
    partial = {k: v for k, v in full.items() if k not in ("guard_peak_load", "command")}
    assert results.missing_provenance(partial) == ["guard_peak_load", "command"]
    assert results.missing_provenance({"machine": {}}) == [a[0] for a in results.PROVENANCE]
    assert results.missing_provenance(full | {"command": "", "guard": None}) == ["guard",
                                                                                 "command"]
