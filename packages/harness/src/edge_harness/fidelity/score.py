"""What a pinned child does for fidelity, on the build it has loaded (through the worker's
`on_runner` request, with only the Scorer protocol of runners.base):

- `write_base`: compute the log-prob rows of every chunk and keep them in a float32 file (as
  llama-perplexity's --kl-divergence-base keeps its base logits, but unquantized);
- `compare`: compute this build's rows chunk by chunk and score them against the base file
  (KLAccumulator), so a test build's logits are never stored;
- `greedy`: greedy continuations of the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from edge_harness.fidelity.metrics import KLAccumulator


def base_path(folder: Path, corpus: str) -> tuple[Path, Path]:
    return folder / f"{corpus}.f32", folder / f"{corpus}.json"


def greedy(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [runner.greedy(ids, n) for ids in prompts]


def write_base(runner, folder: str | Path, corpus: str, chunks: list[list[int]], first: int) -> dict:
    folder = Path(folder)  # a string when it comes from the parent's request
    data, meta = base_path(folder, corpus)
    folder.mkdir(parents=True, exist_ok=True)
    rows = len(chunks[0]) - 1 - first
    vocab = None
    part = data.with_suffix(".part")
    with open(part, "wb") as f:
        for ids in chunks:
            lp = runner.logprobs(ids, first)
            if lp.shape[0] != rows:
                raise RuntimeError(f"expected {rows} rows, got {lp.shape[0]}")
            vocab = lp.shape[1] if vocab is None else vocab
            f.write(lp.numpy().astype(np.float32, copy=False).tobytes())
    part.replace(data)
    info = {"chunks": len(chunks), "rows": rows, "vocab": vocab, "first": first}
    meta.write_text(json.dumps(info))
    return info


def compare(runner, folder: str | Path, corpus: str, chunks: list[list[int]], first: int) -> dict:
    """Per scored position (all chunks in order): kl, same, nll_base, nll_test as lists; the
    parent pools them across corpora before taking statistics."""
    folder = Path(folder)
    data, meta = base_path(folder, corpus)
    info = json.loads(meta.read_text())
    if info["chunks"] != len(chunks) or info["first"] != first:
        raise RuntimeError(f"base logits in {folder} were made for other chunks: {info}")
    rows, vocab = info["rows"], info["vocab"]
    base = np.memmap(data, dtype=np.float32, mode="r", shape=(len(chunks), rows, vocab))
    acc = KLAccumulator()
    for i, ids in enumerate(chunks):
        lp = runner.logprobs(ids, first)
        if tuple(lp.shape) != (rows, vocab):
            raise RuntimeError(f"rows x vocab {tuple(lp.shape)} differ from the base's {(rows, vocab)}")
        targets = torch.tensor(ids[first + 1:])
        acc.add(torch.from_numpy(np.array(base[i])), lp, targets)
    return {"kl": np.concatenate(acc.kl).tolist(), "same": np.concatenate(acc.same).tolist(),
            "nll_base": np.concatenate(acc.nll_base).tolist(),
            "nll_test": np.concatenate(acc.nll_test).tolist()}
