"""What the harness fetches and builds is what uv.lock pinned: the llama-cpp-python sdist is
checked against uv.lock's sha256 before it is extracted or built, and llama.cpp's build tools
are installed at pinned versions and hashes."""

import gzip
import hashlib
import io
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from edge_harness.bench import gguf_build
from edge_harness.fidelity import perplexity_tool
from edge_infer.errors import EdgeInferError

ROOT = Path(__file__).resolve().parents[3]


def locked(name: str) -> dict:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (pkg,) = [p for p in lock["package"] if p["name"] == name]
    return pkg


def fake_sdist() -> bytes:
    """A tar.gz (the same bytes each time) with a converter where the real sdist has one."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"print('not the vendored converter')\n"
        info = tarfile.TarInfo(f"{gguf_build.VENDOR}/convert_hf_to_gguf.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)


@pytest.fixture
def pip_serves_fake_sdist(tmp_path, monkeypatch):
    """pip download "succeeds" with a substituted sdist; any other pip command is recorded."""
    monkeypatch.setenv("EDGE_INFER_HOME", str(tmp_path / "home"))
    other = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[1:4] == ["-m", "pip", "download"]:
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / f"llama_cpp_python-{gguf_build.LLAMA_CPP_PYTHON}.tar.gz").write_bytes(fake_sdist())
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if cmd[1:3] == ["-m", "pip"]:
            other.append(cmd)
            return subprocess.CompletedProcess(cmd, 1, "", "not run in this test")
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    return other


def test_tampered_sdist_is_not_extracted(pip_serves_fake_sdist):
    with pytest.raises(EdgeInferError, match="not uv.lock's") as err:
        gguf_build.converter_dir()
    assert "\n" not in str(err.value)
    harness = gguf_build.harness_home()
    left = sorted(p.relative_to(harness).as_posix() for p in harness.rglob("*"))
    assert left == [f"llama.cpp-convert-{gguf_build.LLAMA_CPP_PYTHON}.lock"]


def test_tampered_sdist_is_not_built(pip_serves_fake_sdist):
    with pytest.raises(EdgeInferError, match="not uv.lock's"):
        perplexity_tool.tool_path()
    assert pip_serves_fake_sdist == []  # neither the build tools nor `pip wheel` ran
    assert not perplexity_tool.tools_dir().exists()


def test_sdist_with_the_pinned_hash_extracts(pip_serves_fake_sdist, monkeypatch):
    monkeypatch.setattr(gguf_build, "SDIST_SHA256", hashlib.sha256(fake_sdist()).hexdigest())
    assert (gguf_build.converter_dir() / "convert_hf_to_gguf.py").is_file()


def test_sdist_pin_is_uv_locks():
    pkg = locked("llama-cpp-python")
    assert pkg["version"] == gguf_build.LLAMA_CPP_PYTHON
    assert pkg["sdist"]["hash"] == f"sha256:{gguf_build.SDIST_SHA256}"


def build_requirements() -> dict[str, tuple[str, list[str]]]:
    """llama_build.txt as {name: (version, [sha256, ...])}; fails on any line not `==` pinned."""
    text = perplexity_tool.BUILD_REQUIREMENTS.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        spec, *opts = line.split()
        name, sep, version = spec.partition("==")
        assert sep, f"{spec}: not pinned to one version"
        out[name] = (version, [o.removeprefix("--hash=sha256:") for o in opts])
    return out


def test_build_tools_are_pinned_with_hashes():
    reqs = build_requirements()
    assert {"scikit-build-core", "cmake", "ninja"} <= set(reqs)
    for name, (_, hashes) in reqs.items():
        assert hashes and all(len(h) == 64 for h in hashes), f"{name} has no sha256"
    for name, (version, hashes) in reqs.items():  # where uv.lock pins it too, the same wheel
        try:
            pkg = locked(name)
        except ValueError:
            continue
        assert pkg["version"] == version, name
        assert set(hashes) <= {w["hash"].removeprefix("sha256:") for w in pkg["wheels"]}, name
