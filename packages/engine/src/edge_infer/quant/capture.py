"""`edge-infer capture MODEL`: per-layer statistics of the activations entering every linear
layer, over corpus windows, saved as safetensors for calibration.

For each `nn.Linear` (by its module name in the HF model), over every token of every window:
- `<name>.input_absmax`   [in_features] float32: max |x| per input channel (outlier channels);
- `<name>.input_mean_abs` [in_features] float32: mean |x| per input channel (AWQ-style salience);
- `<name>.input_abs_percentiles` [len(PERCENTILES)] float32: percentiles of |x| over all values
  (from a fixed-size uniform sample per window when a layer sees more values than SAMPLE).
The safetensors metadata says the model, corpus, windows, tokens and the percentile levels.
`load_stats` reads the file back into ActivationStats per layer, for the quantizer and the
exporter's calibration. The model runs in fp32 eager PyTorch (transformers), the reference.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

PERCENTILES = (50.0, 90.0, 99.0, 99.9, 100.0)
SAMPLE = 1 << 20  # values of |x| kept per layer and window for the percentiles


@dataclass(frozen=True)
class ActivationStats:
    absmax: torch.Tensor
    mean_abs: torch.Tensor
    abs_percentiles: dict[float, float]


class _Collector:
    def __init__(self, in_features: int, seed: int):
        self.absmax = torch.zeros(in_features)
        self.sum_abs = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0
        self.samples: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, _module, args) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs()
        self.absmax = torch.maximum(self.absmax, x.amax(0))
        self.sum_abs += x.sum(0, dtype=torch.float64)
        self.count += x.shape[0]
        flat = x.reshape(-1)
        if flat.numel() > SAMPLE:
            flat = flat[torch.randint(0, flat.numel(), (SAMPLE,), generator=self.gen)]
        self.samples.append(flat.clone())


def capture(hf_dir: Path, corpus: str, windows: int, length: int, out: Path) -> dict:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edge_infer.corpus import token_windows

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    ids = token_windows(corpus, windows, length, tokenizer=tok, vocab=model.config.vocab_size)
    collectors: dict[str, _Collector] = {}
    handles = []
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            collectors[name] = _Collector(mod.in_features, seed=i)
            handles.append(mod.register_forward_pre_hook(collectors[name]))
    if not collectors:
        raise ValueError(f"{hf_dir}: no nn.Linear layers to capture")
    try:
        with torch.inference_mode():
            for w in tqdm(ids, desc="capture", unit="window", file=sys.stderr):
                model(w)
    finally:
        for h in handles:
            h.remove()
    q = torch.tensor([p / 100 for p in PERCENTILES])
    tensors = {}
    for name, c in collectors.items():
        tensors[f"{name}.input_absmax"] = c.absmax.contiguous()
        tensors[f"{name}.input_mean_abs"] = (c.sum_abs / c.count).float().contiguous()
        sample = torch.cat(c.samples)
        if sample.numel() > 1 << 24:  # torch.quantile's input limit
            sample = sample[torch.randperm(sample.numel(), generator=c.gen)[: 1 << 24]]
        tensors[f"{name}.input_abs_percentiles"] = torch.quantile(sample, q).contiguous()
    meta = {"model": str(hf_dir.name), "corpus": corpus, "windows": str(len(ids)),
            "tokens_per_window": str(length), "percentiles": json.dumps(PERCENTILES),
            "layers": str(len(collectors)), "format": "edge-infer activation stats v1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    save_file(tensors, str(part), metadata=meta)
    part.replace(out)
    return {"out": str(out), "layers": len(collectors), "windows": len(ids), "tokens": len(ids) * length}


def load_stats(path: Path) -> dict[str, ActivationStats]:
    """Per linear layer name, its ActivationStats, from a file `capture` wrote."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "edge-infer activation stats v1":
            raise ValueError(f"{path}: not an edge-infer activation stats file")
        levels = json.loads(meta["percentiles"])
        names = {k.rsplit(".", 1)[0] for k in f.keys()}
        out = {}
        for n in sorted(names):
            pct = f.get_tensor(f"{n}.input_abs_percentiles").tolist()
            out[n] = ActivationStats(f.get_tensor(f"{n}.input_absmax"), f.get_tensor(f"{n}.input_mean_abs"),
                                     dict(zip(levels, pct, strict=True)))
    return out
