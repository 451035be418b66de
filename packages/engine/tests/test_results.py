"""Engine records (serve smoke, profiles) say whether the tree they were measured on was clean."""

import shutil
import subprocess

import pytest

from edge_infer.errors import UsageError
from edge_infer.results import context, require_clean

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
