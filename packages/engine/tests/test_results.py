"""Engine records (serve smoke, profiles) say whether the tree they were measured on was clean."""

import shutil
import subprocess

import pytest

from edge_infer.results import context


@pytest.mark.skipif(shutil.which("git") is None, reason="no git here (the engine image ships none)")
def test_context_records_a_dirty_tree(tmp_path, monkeypatch):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "-C", str(tmp_path), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "x"], check=True)
    monkeypatch.chdir(tmp_path)
    assert context()["git_dirty"] is False
    (tmp_path / "f").write_text("b")
    assert context()["git_dirty"] is True
