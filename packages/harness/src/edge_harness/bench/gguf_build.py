"""GGUF builds for llama.cpp, made from the same HF folder every other engine loads.

HF folder -> `convert_hf_to_gguf.py` -> BF16/F16 GGUF -> `llama_cpp.llama_model_quantize`
-> Q4_K_M / Q4_0. The converter is the one vendored in the llama-cpp-python sdist we link
against (0.3.36, llama.cpp 0c1e57098), with its own vendored `gguf-py`: PyPI's gguf 0.19 is too
old for it (`AttributeError: DFLASH`). The sdist is fetched once with pip (a registry client),
checked against uv.lock's sha256 for it, and only then are the converter's files extracted into
`<EDGE_INFER_HOME>/harness/`.

A locally trained byte-level BPE is unknown to the converter's pre-tokenizer table (`BPE
pre-tokenizer was not recognized`); only when it refuses do we map it to "gpt-2" (with the
hyphen), which gives token ids identical to HF's for such tokenizers (*measured*).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from filelock import FileLock

from edge_infer.api import EdgeInferError, home

LLAMA_CPP_PYTHON = "0.3.36"
# uv.lock's sha256 of that sdist; a test holds the two equal. The harness runs installed (an
# image, a wheel), where uv.lock is not at hand, so the pin travels with the code.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
OUTTYPES = {"bf16": "bf16", "f16": "f16", "f32": "f32"}
# llama_ftype values (llama.h); the quantizer reads the BF16 GGUF.
FTYPES = {"q4_k_m": 15, "q4_0": 2, "q4_1": 3, "q5_k_m": 17, "q6_k": 18, "q8_0": 7}
GPT2_FALLBACK = r"""
import logging, runpy, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[1] + "/gguf-py")
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("edge-harness").warning("unknown BPE pre-tokenizer: using 'gpt-2'")
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""
QUANTIZE = r"""
import ctypes, sys, llama_cpp
src, dst, ftype, nthread = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = ftype, nthread
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def harness_home() -> Path:
    return home() / "harness"


def converter_dir() -> Path:
    """The vendored converter, fetched and extracted once."""
    root = harness_home() / f"llama.cpp-convert-{LLAMA_CPP_PYTHON}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / "convert_hf_to_gguf.py").is_file():
            return root
        with tempfile.TemporaryDirectory(prefix="sdist-", dir=root.parent) as tmp:
            sdist = download_sdist(Path(tmp))
            staging = Path(tmp) / "extract"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if _wanted(m.name)]
                _extract(tar, members, staging)
            shutil.move(str(staging / VENDOR), root)
    return root


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Extract plain files and folders only, never outside `dest`. tarfile's "data" filter
    does this where it exists; Python 3.11 before 3.11.4 (Debian bookworm's 3.11.2, our images'
    Python) lacks it, so the same rules are applied by hand there."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in parts:
            raise ValueError(f"refusing to extract {m.name!r} from {tar.name}")
    tar.extractall(dest, members=members)


def _wanted(name: str) -> bool:
    if not name.startswith(VENDOR + "/"):
        return False
    rel = name[len(VENDOR) + 1:]
    return any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in WANTED)


def download_sdist(dest: Path) -> Path:
    print(f"fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist for its GGUF converter "
          "(once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgeInferError(f"could not fetch the llama-cpp-python {LLAMA_CPP_PYTHON} sdist "
                             f"(needed for its convert_hf_to_gguf.py): {last}")
    return verify_sdist(found[0])


def verify_sdist(sdist: Path) -> Path:
    """`sdist` if its sha256 is uv.lock's, before anything reads it: pip takes whatever file its
    configured indexes and find-links folders offer under that name."""
    h = hashlib.sha256()
    with open(sdist, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != SDIST_SHA256:
        raise EdgeInferError(
            f"{sdist.name} has sha256 {h.hexdigest()}, not uv.lock's {SDIST_SHA256}: refusing "
            "to extract or build it (check where pip fetches from: `pip config list`)")
    return sdist


def gguf_path(model: str, quant: str) -> Path:
    return harness_home() / "gguf" / f"{model}-{quant}.gguf"


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    """HF folder -> GGUF of `outtype` (bf16|f16|f32), atomically, cached."""
    if out.is_file():
        return out
    conv = converter_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    env = {**os.environ, "PYTHONPATH": str(conv / "gguf-py"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    base = [str(hf_dir), "--outfile", str(tmp), "--outtype", OUTTYPES[outtype]]
    print(f"converting {hf_dir} -> {out.name}", file=sys.stderr)
    proc = subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), *base],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 and "pre-tokenizer was not recognized" in proc.stderr:
        print(f"{hf_dir.name}: the converter does not know this BPE pre-tokenizer; mapping it "
              "to 'gpt-2' (byte-level BPE)", file=sys.stderr)
        proc = subprocess.run([sys.executable, "-c", GPT2_FALLBACK, str(conv), *base],
                              env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise EdgeInferError(f"convert_hf_to_gguf.py failed for {hf_dir}:\n{tail}")
    os.replace(tmp, out)
    return out


def quantize(src: Path, out: Path, quant: str, threads: int | None = None) -> Path:
    """GGUF -> a llama.cpp quant type through llama_cpp.llama_model_quantize, cached.

    Runs in a subprocess: llama.cpp logs every tensor to stderr, kept for the error message.
    """
    if out.is_file():
        return out
    if quant not in FTYPES:
        raise EdgeInferError(f"llama.cpp quant {quant!r} unknown; known: {sorted(FTYPES)}")
    tmp = out.with_name(f".{out.name}.partial")
    nthread = threads or len(os.sched_getaffinity(0))
    print(f"quantizing {src.name} -> {out.name}", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-c", QUANTIZE, str(src), str(tmp),
                           str(FTYPES[quant]), str(nthread)], capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise EdgeInferError(f"llama_model_quantize {src.name} -> {quant} failed:\n{tail}")
    os.replace(tmp, out)
    return out


def build_gguf(model: str, hf_dir: Path, quant: str) -> Path:
    """The GGUF of `model` at `quant`: converted (bf16/f16/f32) or quantized from the BF16."""
    out = gguf_path(model, quant)
    with FileLock(str(out) + ".lock"):
        if quant in OUTTYPES:
            return convert(hf_dir, out, quant)
        base = gguf_path(model, "bf16")
        with FileLock(str(base) + ".lock"):
            convert(hf_dir, base, "bf16")
        return quantize(base, out, quant)
