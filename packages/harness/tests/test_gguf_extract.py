"""The sdist extraction, with and without tarfile's "data" filter (Debian bookworm's Python
3.11.2, our images' Python, has none): plain files extract, escaping paths are refused."""

import io
import tarfile

import pytest

from edge_harness.bench import gguf_build


def make_tar(path, names):
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("has_filter", [True, False])
def test_plain_members_extract(tmp_path, monkeypatch, has_filter):
    if not has_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    make_tar(tmp_path / "a.tar.gz", ["pkg/vendor/convert.py", "pkg/vendor/gguf-py/x.py"])
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        gguf_build._extract(tar, tar.getmembers(), tmp_path / "out")
    assert (tmp_path / "out/pkg/vendor/gguf-py/x.py").read_text() == "pkg/vendor/gguf-py/x.py"


@pytest.mark.parametrize("has_filter", [True, False])
def test_escaping_members_are_refused(tmp_path, monkeypatch, has_filter):
    if not has_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    make_tar(tmp_path / "bad.tar.gz", ["pkg/../../evil.py"])
    with tarfile.open(tmp_path / "bad.tar.gz") as tar, pytest.raises(Exception):  # noqa: B017
        gguf_build._extract(tar, tar.getmembers(), tmp_path / "out")
    assert not (tmp_path / "evil.py").exists()
