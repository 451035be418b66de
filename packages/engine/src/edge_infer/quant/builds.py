"""Our cached 4-bit builds: one folder per (model, W4Config) under `home()/checkpoints`.

Serve's default build and the harness's builds share this cache, so the folder name is made
here alone. The name holds scheme, group size, zero point and LM head (`-zp`, `-head`):
`smollm2-135m-w4a16-g64-zp-head`. Scale dtype and modules_to_not_convert are not in it; a
profile's [quant] table cannot set the latter (profiles._NOT_KEYS).
"""

from __future__ import annotations

from pathlib import Path

from edge_infer import profiles
from edge_infer.home import home
from edge_infer.quant.config import W4Config


def default_config(model: str) -> W4Config:
    """The 4-bit build a model's profile asks for (the generic profile's where it has none)."""
    return profiles.load(model).quant


def checkpoint_dir(model: str, cfg: W4Config) -> Path:
    """Where the build of `model` at `cfg` is cached (it may not be built yet)."""
    zp = "-zp" if cfg.zero_point else ""
    head = "-head" if cfg.quantize_lm_head else ""
    return home() / "checkpoints" / f"{model}-{cfg.scheme}-g{cfg.group_size}{zp}{head}"


def cached_checkpoint(model: str, cfg: W4Config, hf_dir: Path | None = None) -> Path:
    """The build of `model` at `cfg`, quantized from `hf_dir` on first use and cached. Without
    `hf_dir`, `model` is a registry name, pulled only when the build is missing."""
    out = checkpoint_dir(model, cfg)
    if not (out / "config.json").is_file():
        # imported here: torch takes seconds to import, and `edge-infer --help` or a serve of
        # an already-built checkpoint never needs it in this process
        from edge_infer.models.pull import pull
        from edge_infer.quant.checkpoint import quantize_checkpoint

        quantize_checkpoint(hf_dir or pull(model).hf_dir, out, cfg, overwrite=True)
    return out
