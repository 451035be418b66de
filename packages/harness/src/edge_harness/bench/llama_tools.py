"""llama.cpp's own command-line tools (`llama-perplexity`, `llama-bench`, `llama-server`,
`llama-batched-bench`), built together once from the llama-cpp-python sdist we link (its
vendored llama.cpp, sha256-checked against uv.lock), so they measure the very llama.cpp our
runner loads.

One build makes every tool in TOOLS; a cached tools folder missing one of them (built before
that tool was added) is built again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from edge_harness.bench import gguf_build
from edge_infer.api import EdgeInferError, free_port, serve_process

LLAMA_BENCH = "llama-bench"
LLAMA_SERVER = "llama-server"
LLAMA_BATCHED_BENCH = "llama-batched-bench"
TOOLS = ("llama-perplexity", LLAMA_BENCH, LLAMA_SERVER, LLAMA_BATCHED_BENCH)
# What a record keeps of each llama-bench JSON entry (the rest is the tool's echo of defaults).
KEEP = ("build_commit", "build_number", "cpu_info", "backends", "model_filename", "model_type",
        "model_size", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn",
        "use_mmap", "n_prompt", "n_gen", "avg_ts", "stddev_ts", "samples_ts", "samples_ns")
# The build runs without pip's build isolation, on these tools alone (see the file).
BUILD_REQUIREMENTS = Path(__file__).with_name("llama_build.txt")
# llama-server offline: without the two UI switches its build downloads a prebuilt web UI and
# waits on the network (scripts/ui-assets.cmake); with them it builds without an embedded UI.
# OpenSSL off: the server listens on loopback over plain HTTP, and the build then needs no
# host libssl headers.
CMAKE_ARGS = ("-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF "
              "-DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF")


def tools_dir() -> Path:
    return gguf_build.harness_home() / f"llama.cpp-tools-{gguf_build.LLAMA_CPP_PYTHON}"


def _complete(root: Path) -> bool:
    return all((root / "bin" / t).is_file() for t in TOOLS)


def tool_path(tool: str) -> Path:
    """The binary of `tool` (one of TOOLS); all of them are built on first use (~8 min on 2
    quiet cores)."""
    if tool not in TOOLS:
        raise ValueError(f"{tool}: not one of the llama.cpp tools built here ({', '.join(TOOLS)})")
    root = tools_dir()
    if _complete(root):
        return root / "bin" / tool
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not _complete(root):
            _build(root)
    return root / "bin" / tool


def _build(root: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="tools-", dir=root.parent) as tmp:
        sdist = gguf_build.download_sdist(Path(tmp))  # sha256-checked against uv.lock
        build = Path(tmp) / "build"
        env = {**build_tools(Path(tmp) / "build-tools"), "CMAKE_ARGS": CMAKE_ARGS}
        print(f"building {', '.join(TOOLS)} from {sdist.name} (once; ~8 min on 2 quiet cores)",
              file=sys.stderr, flush=True)
        targets = [a for t in (*TOOLS, "mtmd") for a in ("-C", f"build.targets={t}")]
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
               "--no-build-isolation", "-w", str(Path(tmp) / "wheel"),
               "-C", f"build-dir={build}", *targets, str(sdist)]
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        missing = [t for t in TOOLS if not (build / "bin" / t).is_file()]
        if missing:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise EdgeInferError(f"building {', '.join(missing)} failed "
                                 f"(pip wheel exit {proc.returncode}):\n{tail}")
        (root / "bin").mkdir(parents=True, exist_ok=True)
        for f in (build / "bin").iterdir():  # the tools and the shared libraries they link
            if f.is_file():
                shutil.copy2(f, root / "bin" / f.name)


def build_tools(dest: Path) -> dict[str, str]:
    """Install llama_build.txt (scikit-build-core, cmake, ninja at pinned versions and hashes)
    into `dest`; the environment that puts them first on PYTHONPATH and PATH for the build."""
    cmd = [sys.executable, "-m", "pip", "install", "--require-hashes", "--only-binary", ":all:",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(dest),
           "-r", str(BUILD_REQUIREMENTS)]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgeInferError(f"could not install the pinned build tools of llama.cpp's tools "
                             f"({BUILD_REQUIREMENTS.name}): {last}")
    pythonpath = [str(dest), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath),
            "PATH": f"{dest / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}


def tool_env(binary: Path) -> dict[str, str]:
    """The environment a tool runs in: the shared libraries built with it come first."""
    return {**os.environ,
            "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def llama_bench_args(binary: Path, gguf: str, n_prompt: int, n_gen: int, threads: int) -> list[str]:
    """One `llama-bench` invocation as we run it: one repetition (`-r 1`: the harness repeats
    and interleaves), llama-bench's own warm-up and defaults otherwise, JSON out."""
    return [str(binary), "-m", gguf, "-p", str(n_prompt), "-n", str(n_gen), "-r", "1",
            "-t", str(threads), "-o", "json"]


def batched_bench_args(binary: Path, gguf: str, n_gen: int, batch: int, threads: int) -> list[str]:
    """One `llama-batched-bench` invocation: `batch` sequences of a 1-token prompt each, then
    n_gen steps decoding all of them together (one unified KV cache sized for them), JSONL out."""
    n_ctx = max(256, batch * (n_gen + 1) + 64)
    return [str(binary), "-m", gguf, "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-kvu",
            "-npp", "1", "-ntg", str(n_gen), "-npl", str(batch), "-t", str(threads),
            "--output-format", "jsonl"]


def parse_batched_bench(text: str, n_gen: int, batch: int, threads: int) -> dict:
    """The JSONL entry of `llama-batched-bench --output-format jsonl` for (tg n_gen, pl batch);
    refuses output without exactly one such entry, a positive t_tg and `threads` threads."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("tg") == n_gen and e.get("pl") == batch:
            found.append(e)
    if len(found) != 1:
        raise EdgeInferError(f"{LLAMA_BATCHED_BENCH} printed {len(found)} entries for tg {n_gen}, "
                             f"pl {batch} (expected one); it printed:\n"
                             + "\n".join(text.strip().splitlines()[-10:]))
    e = found[0]
    if e.get("n_threads") not in (None, threads):
        raise EdgeInferError(f"{LLAMA_BATCHED_BENCH} ran {e.get('n_threads')} threads, asked for {threads}")
    if not (isinstance(e.get("t_tg"), (int, float)) and e["t_tg"] > 0):
        raise EdgeInferError(f"{LLAMA_BATCHED_BENCH}: no positive t_tg: {e.get('t_tg')!r}")
    return e


def parse_llama_bench(text: str, threads: int) -> dict[str, dict]:
    """llama-bench's `-o json` output as {"pp": entry, "tg": entry} (entries trimmed to KEEP);
    refuses output that is not one pp and/or one tg test at `threads` threads."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EdgeInferError(f"{LLAMA_BENCH} -o json printed no JSON ({exc}); it printed:\n"
                             + "\n".join(text.strip().splitlines()[-10:])) from None
    out: dict[str, dict] = {}
    for e in entries if isinstance(entries, list) else []:
        test = "pp" if e.get("n_prompt", 0) > 0 and e.get("n_gen", 0) == 0 else (
            "tg" if e.get("n_gen", 0) > 0 and e.get("n_prompt", 0) == 0 else None)
        if test is None or test in out:
            raise EdgeInferError(f"{LLAMA_BENCH}: unexpected test n_prompt={e.get('n_prompt')} "
                                 f"n_gen={e.get('n_gen')} in its JSON")
        if e.get("n_threads") != threads:
            raise EdgeInferError(f"{LLAMA_BENCH} ran {e.get('n_threads')} threads, asked for {threads}")
        if not (isinstance(e.get("avg_ts"), (int, float)) and e["avg_ts"] > 0):
            raise EdgeInferError(f"{LLAMA_BENCH}: {test} has no positive avg_ts: {e.get('avg_ts')!r}")
        out[test] = {k: e[k] for k in KEEP if k in e}
        if "model_filename" in out[test]:  # the file's name, not where this machine keeps it
            out[test]["model_filename"] = Path(str(out[test]["model_filename"])).name
    if not out:
        raise EdgeInferError(f"{LLAMA_BENCH} -o json listed no pp or tg test: {text[:200]!r}")
    return out


def tool_version(binary: Path) -> dict[str, str]:
    """`TOOL --version` as {"version", "build_number", "build_commit", "compiler"}: e.g.
    "version: 0.5.0-dev (build 1, commit 0c1e570)" / "built with GNU 12.2.0 for Linux x86_64"."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                          env=tool_env(binary))
    text = (proc.stdout + proc.stderr).strip()
    match = re.search(r"version: (\S+) \(build (\d+), commit (\w+)\)", text)
    if proc.returncode != 0 or match is None:
        raise EdgeInferError(f"{binary.name} --version printed no build commit "
                             f"(exit {proc.returncode}): {text[:200]!r}")
    built = next((ln.strip() for ln in text.splitlines() if ln.startswith("built with")), "")
    return {"version": match[1], "build_number": match[2], "build_commit": match[3],
            "compiler": built.removeprefix("built with ")}


def start_server(gguf: str, alias: str, log: Path, *, slots: int, ctx_per_slot: int,
                 threads: int | None = None, cores: list[int] | None = None,
                 timeout: float = 900) -> tuple[subprocess.Popen, str, list[str]]:
    """`llama-server` on `gguf` at a free loopback port with `slots` parallel slots of
    `ctx_per_slot` tokens each (continuous batching), pinned to `cores` when given, once /health
    answers: the process, its base URL, and its argv as a record shows it (file name, no port).
    The one launcher of llama-server here (the serving benchmark and the task evaluation)."""
    binary = tool_path(LLAMA_SERVER)
    port = free_port()
    args = ["-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-a", alias,
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching"]
    if threads:
        args += ["-t", str(threads), "-tb", str(threads)]
    shown = [LLAMA_SERVER, "-m", Path(gguf).name, *[a if a != str(port) else "PORT" for a in args[2:]]]
    proc = serve_process.launch([str(binary), *args], log, tool_env(binary), cores)
    base = f"http://127.0.0.1:{port}"
    serve_process.wait_healthy(proc, base, timeout, log, what=LLAMA_SERVER)
    return proc, base, shown
