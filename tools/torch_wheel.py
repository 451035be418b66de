#!/usr/bin/env python3
"""Put the pinned CPU build of torch into ./wheels, where uv.lock expects it.

PyPI's `torch` is the multi-GB CUDA build; the CPU wheel (`torch==2.13.0+cpu`) lives on
PyTorch's own index. uv.lock names it in the `wheels` find-links folder and
tools/torch_wheel.sha256 pins its sha256, so every install path (nox, CI, the images) runs this
first; a wheel that does not match is deleted, never installed. It looks, in order, in:
  1. ./wheels (already there),
  2. the find-links folders of pip's configuration (`pip config list`), e.g. a local mirror,
  3. PyTorch's CPU index, with pip download.
stdlib only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# uv.lock records a find-links wheel by file name only (no hash), so the pin lives in this one
# file, in `sha256sum -c` form: read here, and checked by the Dockerfiles before `uv sync`.
PIN = Path(__file__).resolve().with_name("torch_wheel.sha256")
SHA256, _PINNED_PATH = PIN.read_text().split()
WHEEL = Path(_PINNED_PATH).name
SPEC = f"torch=={WHEEL.split('-')[1]}"  # torch==2.13.0+cpu
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def pip_find_links() -> list[Path]:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, check=False,
        ).stdout
    except OSError:
        return []
    folders = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            for item in value.strip().strip("'\"").split():
                item = item.removeprefix("file://")
                if os.path.isdir(item):
                    folders.append(Path(item))
    return folders


def place(src: Path, dest: Path) -> None:
    tmp = dest.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)  # same filesystem: no copy
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def ensure(dest_dir: Path) -> Path:
    want = SHA256
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / WHEEL
    if dest.is_file() and not dest.is_symlink():
        if sha256(dest) == want:
            return dest
        dest.unlink()
    dest.unlink(missing_ok=True)
    for folder in pip_find_links():
        cand = folder / WHEEL
        if cand.is_file() and sha256(cand) == want:
            place(cand, dest)
            return dest
    print(f"torch_wheel: fetching {SPEC} from {CPU_INDEX}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--index-url", CPU_INDEX,
         "--dest", str(dest_dir), SPEC],
        check=True,
    )
    if sha256(dest) != want:
        dest.unlink()
        sys.exit(f"torch_wheel: {WHEEL} from {CPU_INDEX} does not match the sha256 in "
                 f"{PIN.relative_to(ROOT)}: deleted it, nothing installed")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / "wheels")
    args = parser.parse_args()
    print(ensure(args.dest))


if __name__ == "__main__":
    main()
