"""Build (once, cached) and load edge-infer's C++ kernels (`csrc/edge_w4.cpp`, the 4-bit
linear, and `csrc/edge_layer.cpp`, the fused decoder-layer ops around it).

Compiled from source on first use through `torch.utils.cpp_extension` (no prebuilt
binaries): the build lands under `<edge-infer home>/kernels/<torch version>-<source hash>`,
so a new source or torch version rebuilds and an unchanged one loads in milliseconds.
Instruction sets are chosen at run time inside the library (`target` attributes), so one
build serves every x86-64 CPU.

ninja works in `build/` under that folder; the finished library is copied beside it under a
temporary name and renamed into place, and its sha256 is recorded next to it
(`edge_infer_w4.so.sha256`, sha256sum's format). A library that is missing its record or
does not match it (a build killed mid-link, a changed file) is never loaded: it is rebuilt,
or, where the folder cannot be written, refused with one line.
In the image (docker/engine.Dockerfile) the library is built as root at image build time and
its folder stays root-owned and read-only to the serving user: the hash catches a torn or
corrupted file, the ownership a deliberate change.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from edge_infer.atomic import build_lock, replace_file, sweep, write_bytes
from edge_infer.errors import EdgeInferError
from edge_infer.home import home

log = logging.getLogger(__name__)
SOURCES = tuple(Path(__file__).with_name("csrc") / f for f in ("edge_w4.cpp", "edge_layer.cpp"))


def build_dir() -> Path:
    import torch

    digest = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES)).hexdigest()[:12]
    return home() / "kernels" / f"torch{torch.__version__}-{digest}"


NAME = "edge_infer_w4"


def _import_built(path: Path):
    """Load an already-built library without the build tools (an image ships no compiler)."""
    import importlib.util

    import torch  # noqa: F401  (libtorch's symbols must be loaded first)

    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load():
    """The compiled module; builds it if this source/torch pair has not been built yet."""
    for src in SOURCES:
        if not src.is_file():
            raise FileNotFoundError(f"kernel source missing: {src} (broken install?)")
    built = build_dir() / f"{NAME}.so"
    if verified(built):
        return _import_built(built)
    try:
        with build_lock(built):
            if verified(built):  # another process built it while this one waited
                return _import_built(built)
            if built.exists():
                log.warning("%s does not match the sha256 recorded at its build; rebuilding", built)
            sweep(built)
            return _build(built)
    except PermissionError as exc:
        raise EdgeInferError(
            f"kernel library {built} is missing or fails its sha256 check, and it cannot be "
            f"rebuilt here ({exc}); reinstall, or set EDGE_INFER_HOME to a writable folder"
        ) from None


def record_of(built: Path) -> Path:
    return built.with_name(built.name + ".sha256")


def verified(built: Path) -> bool:
    """Whether `built` exists and matches the sha256 recorded when it was built."""
    try:
        want = record_of(built).read_text().split()[0]
        return sha256_file(built) == want
    except (OSError, IndexError):
        return False


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _build(built: Path):
    import torch.utils.cpp_extension as ce

    _ninja_on_path()
    work = built.parent / "build"
    work.mkdir(parents=True, exist_ok=True)
    print(f"edge-infer: compiling the 4-bit CPU kernels (once, ~1 min) into {built.parent}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    module = ce.load(
        name=NAME,
        sources=[str(src) for src in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(work),
        verbose=bool(os.environ.get("EDGE_INFER_KERNEL_VERBOSE")),
    )
    # Copied, not moved: ninja's folder stays complete, so a rebuild only relinks.
    tmp = built.with_name(f".{built.name}.partial-{os.getpid()}")
    try:
        shutil.copy2(module.__file__, tmp)
        digest = sha256_file(tmp)
        replace_file(tmp, built)
    finally:
        tmp.unlink(missing_ok=True)
    write_bytes(record_of(built), f"{digest}  {built.name}\n".encode())
    log.info("edge-infer kernels built in %.0f s", time.perf_counter() - t0)
    return module


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; a venv used without activation (an image's
    /opt/venv/bin/python) has it only in its own bin folder, from the `ninja` wheel."""
    try:
        import ninja

        where = str(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        where = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if where not in path.split(os.pathsep):
        os.environ["PATH"] = where + (os.pathsep + path if path else "")


def available() -> bool:
    """Whether the kernels can be built/loaded here (a compiler is needed on first use)."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any build failure means: fall back, loudly
        log.warning("edge-infer C++ kernels unavailable (%s: %s); falling back", type(exc).__name__, exc)
        return False
    return True
