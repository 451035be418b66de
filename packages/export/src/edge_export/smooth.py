"""SmoothQuant-style per-channel scales (Xiao et al., 2023), folded into the RMSNorm weights.

In each block two RMSNorms feed linears that share their input x: input_layernorm feeds
q/k/v, post_attention_layernorm feeds gate/up. With, per input channel j,

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)    (W: those linears stacked)

x / s (folded into the norm's weight) times W * s (scaled columns) is the same product in
float, but the activations' outlier channels shrink, so per-token int8 rounds the other
channels finer, and the weight columns that meet large activations grow, so their 4-bit
rounding costs less. alpha = 0 leaves the activations alone and only evens out the weights.
The statistics are taken from the float model over calibration windows (never the scored
ones), before any quantization.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# (norm, linears it feeds) in each block of edge_export.decoder._Block
GROUPS = (("input_layernorm", ("q_proj", "k_proj", "v_proj")),
          ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


def _get(block: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        block = getattr(block, part)
    return block


@torch.no_grad()
def input_absmax(layers: nn.ModuleList, run: Callable[[torch.Tensor], object],
                 windows: Iterable[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """max |x| per input channel of each norm-fed group, per block, over `run(window)` for
    every window (`run` feeds the model that owns `layers`)."""
    stats: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    handles = []
    for i, block in enumerate(layers):
        for norm, linears in GROUPS:
            def hook(_m, args, i=i, norm=norm):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                old = stats[i].get(norm)
                stats[i][norm] = x if old is None else torch.maximum(old, x)
            handles.append(_get(block, linears[0]).register_forward_pre_hook(hook))
    try:
        for w in windows:
            run(w)
    finally:
        for h in handles:
            h.remove()
    if any(len(s) != len(GROUPS) for s in stats):
        raise ValueError("no activations were seen: the windows never reached every block")
    return stats


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                  alpha: float) -> torch.Tensor:
    """s_j for one group (see the module docstring); clamped so no channel divides by ~0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w_absmax = torch.cat([w.detach().abs().float() for w in weights]).amax(0)
    act = act_absmax.float().clamp(min=1e-5)
    s = act.pow(alpha) / w_absmax.clamp(min=1e-5).pow(1.0 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_in_place(layers: nn.ModuleList, stats: list[dict[str, torch.Tensor]],
                    alpha: float) -> None:
    """Fold the scales into each norm's weight and its linears' columns (float-exact)."""
    for block, block_stats in zip(layers, stats, strict=True):
        for norm_name, linear_names in GROUPS:
            norm = getattr(block, norm_name)
            linears = [_get(block, name) for name in linear_names]
            s = smooth_scales(block_stats[norm_name], [m.weight for m in linears], alpha)
            norm.weight.div_(s.to(norm.weight.dtype))
            for m in linears:
                m.weight.mul_(s.to(m.weight.dtype))
