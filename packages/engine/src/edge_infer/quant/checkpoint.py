"""`edge-infer quantize`: a bf16 HF folder -> an `edge_w4` HF folder vLLM loads as is.

Which tensors are quantized: every 2-D `*_proj.weight` inside the decoder layers (attention
and MLP projections; not Spark-X2.5's tiny head-wise gate `g_proj`), and with
`quantize_lm_head` the embedding table and LM head too.
Norms always stay bf16.
Safetensors in, safetensors out: nothing is ever unpickled. The output folder appears only
when complete (edge_infer.atomic: written beside it under a lock, fsynced, then renamed).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from edge_infer.atomic import build_beside
from edge_infer.errors import EdgeInferError, UsageError
from edge_infer.quant.config import W4Config
from edge_infer.quant.primitives import SCALE_DTYPES, check_groupable, pack_nibbles, quantize_w4

LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
# Spark-X2.5's head-wise attention gate (hidden -> one logit per head, 8-16 rows): too small
# to matter, and our vLLM class builds it unquantized.
KEEP = re.compile(r"^model\.layers\.\d+\.self_attn\.g_proj\.weight$")
VOCAB = ("model.embed_tokens.weight", "model.embedding.weight", "lm_head.weight")
# Written by every build, and what --overwrite looks for before it replaces a folder.
MARKER = "edge_infer_quant.json"
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "tokenizer.model",
              "vocab.json", "merges.txt")


@dataclass
class QuantReport:
    out_dir: Path
    quantized: int
    kept: int
    linear_bits_per_weight: float  # over quantized linears: codes + scales (+ zeros)
    model_bits_per_weight: float  # over every parameter, from the bytes written

    def as_dict(self) -> dict:
        return {
            "out_dir": str(self.out_dir), "quantized_tensors": self.quantized,
            "kept_tensors": self.kept,
            "linear_bits_per_weight": round(self.linear_bits_per_weight, 4),
            "model_bits_per_weight": round(self.model_bits_per_weight, 4),
        }


def is_quantized_linear(name: str, cfg: W4Config) -> bool:
    if name in VOCAB:
        return cfg.quantize_lm_head
    if not LINEAR.match(name) or KEEP.match(name):
        return False
    module = name.removesuffix(".weight")
    return not any(module.startswith(p) for p in cfg.modules_to_not_convert)


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise EdgeInferError(f"{model_dir} is not a HF model folder (no config.json)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EdgeInferError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise EdgeInferError(f"{path} is not a HF config (a JSON object)")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method")
        raise EdgeInferError(f"{model_dir} is already quantized ({method}); give a bf16/fp32 model")
    return config


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
        hint = " (pickled .bin/.pt weights are refused: convert them to safetensors)" if bins else ""
        raise EdgeInferError(f"no .safetensors weights in {model_dir}{hint}")
    return files


def quantize_tensors(tensors: dict[str, torch.Tensor], cfg: W4Config) -> dict[str, torch.Tensor]:
    """The in-memory form of the checkpoint: what `quantize_checkpoint` writes, tensor for tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_quantized_linear(name, cfg):
            prefix = name.removesuffix(".weight")
            check_groupable(tuple(t.shape), cfg.group_size, prefix)
            q, scale, zero = quantize_w4(
                t, cfg.group_size, cfg.zero_point, SCALE_DTYPES[cfg.scale_dtype]
            )
            out[f"{prefix}.qweight"] = pack_nibbles(q).contiguous()
            out[f"{prefix}.scales"] = scale.contiguous()
            if zero is not None:
                out[f"{prefix}.qzeros"] = zero.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in weight_files(model_dir):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                tensors[name] = sf.get_tensor(name)
    return tensors


def quantize_checkpoint(model_dir: Path, out_dir: Path, cfg: W4Config,
                        overwrite: bool = False) -> QuantReport:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    files = weight_files(model_dir)
    check_replaceable(out_dir, overwrite)  # before the lock: a refusal leaves nothing behind
    with build_beside(out_dir) as tmp:
        # again under the lock: a build that waited for another sees what that one wrote
        check_replaceable(out_dir, overwrite)
        n_q = n_kept = 0
        q_weights = q_bytes = 0
        total_params = 0
        weight_map = {}
        for i, f in enumerate(files):
            shard = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            out: dict[str, torch.Tensor] = {}
            with safe_open(f, "pt") as sf:
                for name in tqdm(list(sf.keys()), desc=f"quantize {f.name}", unit="tensor"):
                    t = sf.get_tensor(name)
                    total_params += t.numel()
                    if is_quantized_linear(name, cfg):
                        n_q += 1
                        q_weights += t.numel()
                        parts = quantize_tensors({name: t}, cfg)
                        q_bytes += sum(p.numel() * p.element_size() for p in parts.values())
                        out.update(parts)
                    else:
                        n_kept += 1
                        out[name] = t.contiguous()
            weight_map.update(dict.fromkeys(out, shard))
            save_file(out, tmp / shard, metadata={"format": "pt"})
            del out
        if len(files) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
            )
        config["quantization_config"] = cfg.to_hf()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in COPY_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        data_bytes = sum(
            _tensor_bytes(p) for p in tmp.glob("*.safetensors")
        )
        report = QuantReport(
            out_dir=out_dir, quantized=n_q, kept=n_kept,
            linear_bits_per_weight=8 * q_bytes / max(q_weights, 1),
            model_bits_per_weight=8 * data_bytes / max(total_params, 1),
        )
        (tmp / MARKER).write_text(json.dumps(report.as_dict() | {
            "source": str(model_dir.name), "config": cfg.to_hf()}, indent=2) + "\n")
    return report


def check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """--overwrite replaces only what quantize wrote: a folder holding MARKER (or nothing)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise UsageError(f"OUT_DIR {out_dir} is not a folder; give a new folder path "
                         "(nothing was written)")
    if not out_dir.exists():
        return
    if not overwrite:
        raise UsageError(f"{out_dir} exists; remove it or pass --overwrite")
    if not (out_dir / MARKER).is_file() and any(out_dir.iterdir()):
        raise UsageError(f"OUT_DIR {out_dir} is not an edge-infer checkpoint (no {MARKER}), "
                         "so --overwrite leaves it alone; give another folder or remove it yourself")


def _tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (its size minus the JSON header)."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header
