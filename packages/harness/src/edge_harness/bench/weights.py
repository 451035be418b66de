"""What a build stores and what a decode step reads, from the files themselves.

- bits/weight = 8 x stored tensor bytes / parameters of the source HF model (so scales, zero
  points, and tensors a format keeps at higher precision all count, for every engine alike);
- weight bytes per decode token = every stored tensor, except the token embedding when the
  model has a separate output head (a decode step reads one row of it). With tied embeddings
  the embedding *is* the head and is read in full. KV-cache reads are not counted: at the
  contexts of tg128 they are a few percent of the weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4,
               "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# Name prefixes: a 4-bit vocabulary tensor is stored as several (.qweight, .scales, ...).
HF_EMBED = ("model.embed_tokens.", "model.embedding.")
HF_HEAD = ("lm_head.",)
GGUF_EMBED = ("token_embd.",)
GGUF_HEAD = ("output.",)


def safetensors_tensors(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (bytes, elements) for every tensor of the *.safetensors files in `folder`."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            numel = 1
            for d in meta["shape"]:
                numel *= d
            out[name] = (hi - lo, numel)
    if not out:
        raise FileNotFoundError(f"no safetensors tensors in {folder}")
    return out


def gguf_tensors(path: Path) -> dict[str, tuple[int, int]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {t.name: (int(t.n_bytes), int(t.n_elements)) for t in reader.tensors}


def decode_bytes(tensors: dict[str, tuple[int, int]], embed: tuple[str, ...],
                 head: tuple[str, ...]) -> int:
    total = sum(b for b, _ in tensors.values())
    if any(name.startswith(head) for name in tensors):
        # a separate output head: the embedding lookup reads one row, not the matrix
        total -= sum(b for name, (b, _) in tensors.items() if name.startswith(embed))
    return total


def source_params(hf_dir: Path) -> int:
    return sum(n for _, n in safetensors_tensors(hf_dir).values())


def hf_build_facts(folder: Path, params: int) -> tuple[float, int]:
    """(bits/weight, decode bytes/token) of a HF-style folder (bf16 or our edge_w4)."""
    t = safetensors_tensors(folder)
    stored = sum(b for b, _ in t.values())
    return 8 * stored / params, decode_bytes(t, HF_EMBED, HF_HEAD)


def gguf_build_facts(path: Path, params: int) -> tuple[float, int]:
    t = gguf_tensors(path)
    stored = sum(b for b, _ in t.values())
    return 8 * stored / params, decode_bytes(t, GGUF_EMBED, GGUF_HEAD)
