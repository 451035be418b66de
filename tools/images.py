#!/usr/bin/env python3
"""Build the images, and run each package's tests inside its image. The nox sessions `images`,
`tests-image` and `tests-in-image` call this; it runs without nox too:

    python tools/images.py check                      # exit 0 if a Docker API answers
    python tools/images.py build [engine harness export]
    python tools/images.py test [--env=K=V ...] [engine harness export] [-- PYTEST-ARGS]

Names default to every image. A Docker API comes from Docker or from podman's
(`eval "$(sudo tools/podman_setup.sh)"`, which also sets EDGE_INFER_BASE_IMAGE to a local
bookworm: BASE_IMAGE is taken from that variable when set). stdlib only: it runs with nox's
own interpreter.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {"engine": "edge-infer", "harness": "edge-infer-harness", "export": "edge-infer-export"}
# Free disk one image build needs at its peak, measured on the engine image: its build stage
# (~4 GB), its final stage (~2.6 GB) and the copy of the largest layer while it is committed.
IMAGE_BUILD_GB = 9
# The classic builder: podman's Docker API serves no BuildKit.
BUILD_ENV = {"DOCKER_BUILDKIT": "0"}


class Failed(Exception):
    """A step failed: the message is the one line printed before exiting 1."""


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def run(*args: str, silent: bool = False, ok: tuple[int, ...] = (0,),
        env: dict[str, str] | None = None) -> str:
    """Run a command from the repository root, its output on the terminal (or, `silent`,
    captured and shown only if it fails); returns the captured stdout."""
    log("$ " + " ".join(args))
    out = subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or {})}, text=True,
                         stdout=subprocess.PIPE if silent else None,
                         stderr=subprocess.STDOUT if silent else None)
    if out.returncode not in ok:
        if silent and out.stdout:
            print(out.stdout, file=sys.stderr)
        raise Failed(f"`{' '.join(args)}` failed with exit status {out.returncode}")
    return out.stdout or ""


def docker_ok() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "version"], capture_output=True).returncode == 0


def names_of(args: list[str]) -> list[str]:
    names = args or list(IMAGES)
    unknown = sorted(set(names) - set(IMAGES))
    if unknown:
        raise Failed(f"unknown image(s) {unknown}: choose from {sorted(IMAGES)}")
    return names


def storage_root() -> str:
    return next((p for p in ("/var/lib/containers", "/var/lib/docker") if os.path.isdir(p)), "/")


def free_gib() -> float:
    return shutil.disk_usage(storage_root()).free / 2**30


def require_disk(gb: float) -> None:
    """Fail early and clearly, not with ENOSPC halfway through a build, when the container
    storage (podman's or Docker's root, else /) has less than `gb` GiB free."""
    root, free = storage_root(), free_gib()
    log(f"{root}: {free:.1f} GiB free (an image build needs about {gb} GiB)")
    if free < gb:
        raise Failed(f"{root} has {free:.1f} GiB free, an image build needs about {gb} GiB: "
                     "free some (`docker image prune -a` drops every unused image)")


REVISION_LABEL = "org.opencontainers.image.revision"


def revision() -> str:
    """The tree's commit, `-dirty` when tracked files differ from it; "unknown" without git."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode:
        return "unknown"
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                             "--untracked-files=no"], capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def build(names: list[str]) -> None:
    """`docker build` each image; its build stage is tagged IMAGE-build too."""
    # the images install the pinned CPU torch wheel from ./wheels
    run(sys.executable, str(ROOT / "tools" / "torch_wheel.py"), silent=True)
    # A TLS-intercepting proxy's CAs (the host's local CAs) are trusted by the build stage only.
    for crt in glob.glob("/usr/local/share/ca-certificates/*.crt"):
        shutil.copy(crt, ROOT / "docker" / "ca")
    base = os.environ.get("EDGE_INFER_BASE_IMAGE")
    for name in names:
        image = IMAGES[name]
        # Every rebuild leaves the previous image's layers untagged: on a machine that builds
        # often (CI) they fill the disk (a CI run failed with ENOSPC copying the venv). Drop
        # them first, then check the room one build needs.
        run("docker", "image", "prune", "-f", silent=True)
        if free_gib() < IMAGE_BUILD_GB:  # still short: this image's last build goes too
            log(f"low on disk: removing the previous {image} images first")
            run("docker", "image", "rm", "-f", image, f"{image}-build", ok=(0, 1))
            run("docker", "image", "prune", "-f", silent=True)
        require_disk(IMAGE_BUILD_GB)
        # --force-rm: a failed step's container is removed too (left behind, it holds its
        # half-written layer on disk)
        args = ["docker", "build", "--force-rm", "-f", f"docker/{name}.Dockerfile"]
        if base:
            args += ["--build-arg", f"BASE_IMAGE={base}"]
        # The build stage is tagged too, so the prune above keeps its layers as the cache of
        # the next build (untagged, they would be pruned and every build would start cold).
        run(*args, "--target", "build", "-t", f"{image}-build", ".", env=BUILD_ENV)
        # the commit it was built from, on the image itself: a record taken from a container
        # (the compose stack's scale-out timing) names the code that served, and the engine
        # image has no git to ask
        run(*args, "--label", f"{REVISION_LABEL}={revision()}", "-t", image, ".", env=BUILD_ENV)
        run("docker", "image", "ls", image)


def test(names: list[str], pytest_args: list[str], env: list[str]) -> None:
    """Each package's tests inside its own image (built by `build`), against the code installed
    there: docker/test.Dockerfile adds the test tools, and a copy of the tree is mounted
    read-only for the tests alone. `env`: K=V pairs set in the test container."""
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
            test_in(IMAGES[name], name, stage / "repo", pytest_args, env)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def test_in(image: str, name: str, repo: Path, pytest_args: list[str], env: list[str]) -> None:
    """One package's tests inside `image` (+ the test tools), `repo` mounted read-only."""
    run("docker", "build", "--force-rm", "-f", "docker/test.Dockerfile",
        "--build-arg", f"IMAGE={image}", "-t", f"{image}-test", ".", env=BUILD_ENV)
    # Detached, then `docker wait` for the exit status: podman's Docker API reports 0 for
    # an attached `docker run` whatever the command returned.
    cid = run("docker", "run", "-d", "-v", f"{repo}:/repo:ro", *(f"--env={kv}" for kv in env),
              f"{image}-test", f"packages/{name}/tests", *pytest_args,
              silent=True).strip().splitlines()[-1]
    try:
        run("docker", "logs", "-f", cid)
        status = run("docker", "wait", cid, silent=True).strip()
    finally:
        run("docker", "rm", "-f", cid, silent=True)
    if status != "0":
        raise Failed(f"{name} tests failed inside {image} (exit status {status})")


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command == "check":
            if docker_ok():
                return 0
            log("no Docker API: `docker version` fails or there is no `docker`")
            return 1
        if command == "build":
            build(names_of(args))
            return 0
        if command == "test":
            env = []
            while args and args[0].startswith("--env="):
                env.append(args.pop(0).removeprefix("--env="))
            # image names first, then (after --) pytest's arguments, e.g. `engine -- -k kernels`
            names = [a for a in args if a in IMAGES] or list(IMAGES)
            test(names, [a for a in args if a not in IMAGES and a != "--"], env)
            return 0
    except Failed as exc:
        log(f"error: {exc}")
        return 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
