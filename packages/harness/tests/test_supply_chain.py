"""What the tree fetches, builds and installs is what was pinned: the llama-cpp-python sdist is
checked against uv.lock's sha256 before it is extracted or built, its build backend and tools
come at pinned versions (and hashes, where pip builds it), the CPU torch wheel is checked against
one pinned sha256 wherever it is installed, and no install line of noxfile.py, the Dockerfiles or
CI takes a version range."""

import ast
import gzip
import hashlib
import importlib.util
import io
import re
import shlex
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from edge_harness.bench import gguf_build, llama_tools
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
        llama_tools.tool_path("llama-bench")
    assert pip_serves_fake_sdist == []  # neither the build tools nor `pip wheel` ran
    assert not llama_tools.tools_dir().exists()


def test_sdist_with_the_pinned_hash_extracts(pip_serves_fake_sdist, monkeypatch):
    monkeypatch.setattr(gguf_build, "SDIST_SHA256", hashlib.sha256(fake_sdist()).hexdigest())
    assert (gguf_build.converter_dir() / "convert_hf_to_gguf.py").is_file()


def test_sdist_pin_is_uv_locks():
    pkg = locked("llama-cpp-python")
    assert pkg["version"] == gguf_build.LLAMA_CPP_PYTHON
    assert pkg["sdist"]["hash"] == f"sha256:{gguf_build.SDIST_SHA256}"


def build_requirements() -> dict[str, tuple[str, list[str]]]:
    """llama_build.txt as {name: (version, [sha256, ...])}; fails on any line not `==` pinned."""
    text = llama_tools.BUILD_REQUIREMENTS.read_text().replace("\\\n", " ")
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



def test_uv_builds_the_sdist_with_the_same_backend():
    """uv sync builds llama-cpp-python from its sdist too (the venvs, the harness image): its
    build constraints are llama_build.txt's versions of the backend and its dependencies."""
    uv = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]
    constraints = dict(c.split("==") for c in uv["build-constraint-dependencies"])
    reqs = build_requirements()
    assert constraints == {name: reqs[name][0] for name in ("scikit-build-core", "pathspec",
                                                            "packaging")}
    lock = tomllib.loads((ROOT / "uv.lock").read_text())["manifest"]["build-constraints"]
    assert {c["name"]: c["specifier"] for c in lock} == {k: f"=={v}" for k, v in constraints.items()}

# The install lines of the tree: every package comes at an exact version, from a lock, or from a
# requirements file with hashes. A version range is whatever the index serves that day.

VALUE_OPTIONS = {"-p", "--python", "-t", "--target", "--prefix", "--root", "-c", "--constraint",
                 "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
EXACT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+")


def unpinned(args: list[str]) -> list[str]:
    """The requirements of one `pip install` / `uv pip install` (its arguments after `install`)
    that do not name one exact version: `-r` needs --require-hashes, our own tree --no-deps."""
    bad, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-r", "--requirement"):
            if "--require-hashes" not in args:
                bad.append(f"-r {args[i + 1]} without --require-hashes")
            i += 2
            continue
        if a in VALUE_OPTIONS:
            i += 2
            continue
        if not a.startswith("-"):
            if a.startswith((".", "/")):  # the workspace's own packages, from the tree
                if "--no-deps" not in args:
                    bad.append(f"{a} without --no-deps (its dependencies would be resolved)")
            elif not EXACT.fullmatch(a):
                bad.append(a)
        i += 1
    return bad


def shell_installs(command: str) -> list[list[str]]:
    """The argument lists after `pip install` in a shell line (any pip: python -m pip, uv pip)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, words = [], [*lexer, ";"]
    for i in range(len(words) - 1):
        if words[i].rsplit("/", 1)[-1] == "pip" and words[i + 1] == "install":
            end = next(j for j in range(i, len(words)) if words[j] in ("&&", "||", ";", "|", "&"))
            out.append(words[i + 2:end])
    return out


def dockerfile_runs(path: Path) -> list[str]:
    """Each RUN of a Dockerfile as one line, its ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args, runs = {}, []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("ARG ") and "=" in line:
            name, _, value = line[4:].partition("=")
            args[name.strip()] = value.strip().strip('"')
        elif line.startswith("RUN "):
            runs.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), line[4:]))
    return runs


@pytest.mark.parametrize("line, bad", [
    ('pip install "uv==0.13.9"', []),
    ("python -m pip install 'pytest>=8.3' openai", ["pytest>=8.3", "openai"]),
    ("uv pip install --python /v/bin/python -r dev.txt && echo ok", ["-r dev.txt without --require-hashes"]),
    ("uv pip install --require-hashes -r dev.txt", []),
    ("uv pip install --target /opt/app ./packages/engine", ["./packages/engine without --no-deps (its "
                                                           "dependencies would be resolved)"]),
    ('pip install "nox[uv]==2026.10.20"; pip install torch', ["torch"]),
])
def test_the_pin_check_itself(line, bad):
    assert [b for args in shell_installs(line) for b in unpinned(args)] == bad


DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_are_pinned(path):
    runs = dockerfile_runs(path)
    bad = [b for run in runs for args in shell_installs(run) for b in unpinned(args)]
    assert not bad, f"{path.name}: unpinned install(s) {bad}"
    for run in runs:
        if "uv sync" in run:
            assert "--frozen" in run or "--locked" in run, f"{path.name}: uv sync off uv.lock"


def test_ci_installs_are_pinned():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    bad = [b for line in lines for args in shell_installs(line) for b in unpinned(args)]
    assert not bad, f".ci/run: unpinned install(s) {bad}"


def noxfile_installs() -> list[tuple[int, list[str]]]:
    """(line, arguments) of each package install in noxfile.py: `session.install(...)` and the
    `pip install` of any session.run*. An argument not written out literally is reported as is."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str)
                else f"<{ast.unparse(a)}>" for a in node.args]
        if node.func.attr == "install":
            out.append((node.lineno, args))
        elif node.func.attr.startswith("run"):
            for i in range(len(args) - 1):
                if args[i].rsplit("/", 1)[-1] == "pip" and args[i + 1] == "install":
                    out.append((node.lineno, args[i + 2:]))
    return out


def test_noxfile_installs_are_pinned():
    bad = [(line, b) for line, args in noxfile_installs() for b in unpinned(args)]
    assert not bad, f"noxfile.py: unpinned install(s) (line, requirement): {bad}"


def test_noxfile_syncs_from_the_lock_after_the_torch_wheel_check():
    """Every `uv sync` of noxfile.py is --frozen, and its function runs tools/torch_wheel.py
    (which deletes a wheel that is not the pinned one) before it."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    syncs = 0
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        lists = [n for n in ast.walk(fn) if isinstance(n, ast.List)
                 and [getattr(e, "value", None) for e in n.elts[:2]] == ["uv", "sync"]]
        for lst in lists:
            syncs += 1
            assert "--frozen" in [getattr(e, "value", None) for e in lst.elts], fn.name
            checks = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Constant)
                      and n.value == "torch_wheel.py"]
            assert checks and min(checks) < lst.lineno, f"{fn.name}: uv sync before torch_wheel.py"
    assert syncs, "noxfile.py has no `uv sync` left: update this test"


# The CPU torch wheel: one sha256, in tools/torch_wheel.sha256, read by tools/torch_wheel.py and
# checked by `sha256sum --check` in every image before uv installs it.

PIN = ROOT / "tools" / "torch_wheel.sha256"


def torch_wheel():
    spec = importlib.util.spec_from_file_location("torch_wheel", ROOT / "tools" / "torch_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_pin_is_one_file_that_torch_wheel_reads():
    sha, path = re.fullmatch(r"([0-9a-f]{64})  (wheels/torch-[^\s/]+\.whl)\n", PIN.read_text()).groups()
    tw = torch_wheel()
    assert (tw.SHA256, tw.WHEEL) == (sha, Path(path).name)
    assert tw.SPEC == "torch==2.13.0+cpu"  # the version uv.lock holds
    assert locked("torch")["version"] == tw.SPEC.split("==")[1]


@pytest.mark.parametrize("path", [p for p in DOCKERFILES if "uv sync" in p.read_text()],
                         ids=lambda p: p.name)
def test_dockerfile_checks_torch_wheel_before_uv_sync(path):
    text = re.sub(r"\\\n", " ", path.read_text())
    check = text.find("sha256sum --check --strict tools/torch_wheel.sha256")
    assert "COPY tools/torch_wheel.sha256 tools/" in text, path.name
    assert 0 <= check < text.find("uv sync"), f"{path.name}: torch is installed unchecked"
    assert "!tools/torch_wheel.sha256" in (ROOT / ".dockerignore").read_text().splitlines()


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum (coreutils) here")
def test_dockerfile_check_rejects_a_tampered_wheel(tmp_path):
    (tmp_path / "tools").mkdir()
    shutil.copy(PIN, tmp_path / "tools")
    wheel = tmp_path / PIN.read_text().split()[1]
    wheel.parent.mkdir()
    wheel.write_bytes(b"not torch")
    proc = subprocess.run(["sha256sum", "--check", "--strict", "tools/torch_wheel.sha256"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "FAILED" in proc.stdout


def test_torch_wheel_deletes_a_tampered_download(tmp_path, monkeypatch):
    tw = torch_wheel()
    monkeypatch.setattr(tw, "pip_find_links", lambda: [])
    (tmp_path / tw.WHEEL).write_bytes(b"stale, not torch")

    def pip_download(cmd, **kwargs):
        (Path(cmd[cmd.index("--dest") + 1]) / tw.WHEEL).write_bytes(b"not torch either")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tw.subprocess, "run", pip_download)
    with pytest.raises(SystemExit, match="does not match the sha256 in tools/torch_wheel.sha256"):
        tw.ensure(tmp_path)
    assert not (tmp_path / tw.WHEEL).exists()
