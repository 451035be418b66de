"""Files a user can trust: what edge-infer builds appears whole, or not at all.

A build of TARGET is written into `.TARGET.partial-*` beside it, under an exclusive lock on
`.TARGET.lock` (fcntl.flock: released by the kernel when its process dies, so a killed build
never blocks the next one). Once complete it is fsynced, files and folders, and swapped in by
one rename; a copy it replaces is removed only after the new one is in place. A killed build
leaves only a partial folder that nothing loads, and the next build of TARGET sweeps it: that
build holds the lock, so no live build can own it.

A record file (JSONL, edge_infer.results) grows by `append_line`: one whole line per write,
fsynced, so a killed run leaves every line it finished and at most one torn last line, which
readers skip and the next append cuts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import glob
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fsync_dir(path: Path) -> None:
    """Make the names in `path` durable (a rename is a change to its folder, not to the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder bottom-up. Without it, ext4 can show
    the new name after a power cut with the files behind it still empty."""
    if not root.is_dir():
        _fsync_file(root)
        return
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                _fsync_file(path)
        fsync_dir(Path(dirpath))


def _fsync_file(path: os.PathLike | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(src: Path, dst: Path) -> None:
    """Rename a fully written `src` over `dst`, durably."""
    _fsync_file(src)
    os.replace(src, dst)
    fsync_dir(dst.parent)


def append_line(path: Path, line: bytes) -> None:
    """Append one newline-terminated `line` to `path` so that a kill at any moment leaves every
    line whole: one write() on an O_APPEND descriptor (the kernel places it at the end in one
    step, also against other appenders), then fsync. A last line left without its newline by
    an earlier crash is cut first, so the new line does not glue onto it."""
    if not line.endswith(b"\n"):
        raise ValueError("append_line takes one whole line, ending in a newline")
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        torn = _torn_tail(fd, end)
        if torn:
            log.warning("%s: dropping a torn last line (%d bytes) before appending", path, torn)
            end -= torn
            os.ftruncate(fd, end)
        written = os.write(fd, line)
        if written != len(line):  # only on a full disk: take the fragment back, and say so
            os.ftruncate(fd, end)
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes (truncated back)")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new name is a change to the folder
        fsync_dir(path.parent)


def _torn_tail(fd: int, end: int) -> int:
    """Bytes after the last newline of the file (0 when it ends with one, or is empty)."""
    size = 0
    while end - size > 0:
        step = min(4096, end - size)
        chunk = os.pread(fd, step, end - size - step)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return size + step - cut - 1
        size += step
    return size


def write_bytes(path: Path, data: bytes) -> None:
    """`path.write_bytes(data)` that a crash leaves either old or new, never torn."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Hold `.TARGET.lock` beside `target` for one build; a second build waits, saying for whom.

    The lock file is never deleted: a waiter may already hold it open, and would then lock a
    file nobody else sees.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(f".{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            print(f"edge-infer: waiting for another build of {target} (pid {holder} holds "
                  f"{lock})", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def sweep(target: Path) -> None:
    """Remove what killed builds of `target` left beside it. Call only under build_lock."""
    stem = glob.escape(f".{target.name}.")
    for partial in target.parent.glob(stem + "partial-*"):
        _remove(partial)
    for old in target.parent.glob(stem + "old-*"):
        if os.path.lexists(target):
            _remove(old)
        else:  # killed between the two renames of swap_in's fallback: put the old copy back
            os.replace(old, target)


@contextlib.contextmanager
def build_beside(target: Path) -> Iterator[Path]:
    """A fresh folder to build `target` in, under its lock; on success it replaces `target`."""
    with build_lock(target):
        sweep(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a build is readable like any file
        try:
            yield tmp
            swap_in(tmp, target)
        except BaseException:
            _remove(tmp)
            raise


def swap_in(new: Path, target: Path) -> None:
    """Put the complete folder `new` at `target`, with no moment where `target` is missing;
    the copy it replaces is deleted after."""
    fsync_tree(new)
    if _exchange(new, target):  # `target` is now the new build, `new` names the old copy
        fsync_dir(target.parent)
        _remove(new)
        return
    if not os.path.lexists(target):
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    # A filesystem without RENAME_EXCHANGE: two renames. A process killed between them
    # leaves `.TARGET.old-PID`, which the next build's sweep renames back.
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, old)
    os.replace(new, target)
    fsync_dir(target.parent)
    _remove(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where `b` does
    not exist or the libc, kernel or filesystem lacks it."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
