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

    def seen(i: int, j: int, x: torch.Tensor) -> None:
        norm = GROUPS[j][0]
        x = x.abs().amax(0).float()
        old = stats[i].get(norm)
        stats[i][norm] = x if old is None else torch.maximum(old, x)

    _watch_inputs(layers, GROUPS, seen, run, windows)
    if any(len(s) != len(GROUPS) for s in stats):
        raise ValueError("no activations were seen: the windows never reached every block")
    return stats


def _watch_inputs(layers: nn.ModuleList, sites, seen: Callable[[int, int, torch.Tensor], None],
                  run: Callable[[torch.Tensor], object], windows: Iterable[torch.Tensor]) -> None:
    """`seen(block, site, x)` with the input rows [rows, in_features] of each site's first
    linear (sites: (producer, linears) pairs), for `run(window)` of every window."""
    handles = []
    for i, block in enumerate(layers):
        for j, (_, linears) in enumerate(sites):
            def hook(_m, args, i=i, j=j):
                seen(i, j, args[0].detach().reshape(-1, args[0].shape[-1]))
            handles.append(_get(block, linears[0]).register_forward_pre_hook(hook))
    try:
        for w in windows:
            run(w)
    finally:
        for h in handles:
            h.remove()


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


# --- Grid-keeping scales: one scale per group of `group` input channels -------------------
#
# The per-channel scales above move a Q4_1-style checkpoint's weights off their grid (every
# column of a group gets its own factor), which cost more than the kinder activations gained.
# A scale that is constant over each weight group of 32 input channels keeps the grid: the
# group's d q + min becomes (s d) q + s min, which the float-zero split (xnnpack.lower) still
# takes exactly. Each site folds 1/s into what produces its input, so the float model is
# unchanged: the norms for q/k/v and gate/up, and the up projection's rows (any per-row
# factor keeps a row's grid) for down. o_proj is left out: its input's producer, v_proj, also
# feeds the sink prefix's cached values, which are computed once from the float model.
#
# Which scale: per layer and site, the candidate whose int8 per-token activations (asymmetric,
# as torchao's 8da configs quantize them) lose least of X W^T on calibration inputs, among
#   s_g = a_g^alpha / w_g^beta,  (alpha, beta) in CANDIDATES,
# with a_g, w_g the group's max |x| and max |W|; (0, 0) is "no scale", so a site is never made
# worse on the calibration inputs than without one.

GRID_SITES = (("input_layernorm", ("q_proj", "k_proj", "v_proj")),
              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
              ("mlp.up_proj", ("mlp.down_proj",)))
_STEPS = tuple(i / 10 for i in range(11))
CANDIDATES = ((0.0, 0.0), *((a, 1.0 - a) for a in _STEPS), *((a, 0.0) for a in _STEPS[1:]))


@torch.no_grad()
def input_samples(layers: nn.ModuleList, run: Callable[[torch.Tensor], object],
                  windows: Iterable[torch.Tensor], stride: int = 1) -> list[list[torch.Tensor]]:
    """Every `stride`-th input row of each grid site's linears, per block, over `run(window)`
    for every window (fp32, [rows, in_features])."""
    rows: list[list[list[torch.Tensor]]] = [[[] for _ in GRID_SITES] for _ in layers]
    _watch_inputs(layers, GRID_SITES, lambda i, j, x: rows[i][j].append(x[::stride].float()),
                  run, windows)
    if any(not site for block in rows for site in block):
        raise ValueError("no activations were seen: the windows never reached every block")
    return [[torch.cat(site) for site in block] for block in rows]


def fake_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x through asymmetric int8 per row (range widened to hold 0), and back."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    step = ((hi - lo) / 255).clamp(min=torch.finfo(torch.float32).tiny)
    zero = torch.round(-128 - lo / step)
    return (torch.clamp(torch.round(x / step) + zero, -128, 127) - zero) * step


def group_scales(x: torch.Tensor, weight: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, list[float], int]:
    """The grid-keeping scale per input channel for inputs `x` [rows, in] of `weight`
    [out, in] (the site's linears stacked), each candidate's relative error, and the index in
    CANDIDATES of the one chosen (the least error)."""
    if x.shape[1] % group:
        raise ValueError(f"in_features {x.shape[1]} is not a multiple of the group {group}")
    w = weight.float()
    ref = x @ w.T
    a = x.abs().amax(0).view(-1, group).amax(-1).clamp(min=1e-5)
    wmax = w.abs().amax(0).view(-1, group).amax(-1).clamp(min=1e-5)
    norm = ref.pow(2).sum().clamp(min=1e-30)
    scales, errors = [], []
    for alpha, beta in CANDIDATES:
        s = (a.pow(alpha) / wmax.pow(beta)).repeat_interleave(group)
        scales.append(s)
        errors.append(float((fake_int8_per_token(x / s) @ (w * s).T - ref).pow(2).sum() / norm))
    pick = min(range(len(errors)), key=errors.__getitem__)
    return scales[pick], errors, pick


@torch.no_grad()
def grid_smooth_in_place(layers: nn.ModuleList, samples: list[list[torch.Tensor]],
                         group: int) -> list[dict]:
    """Fold each site's grid-keeping scale into its linears' columns and its producer (float-
    exact); returns, per block and site, the chosen candidate and its error against none."""
    chosen = []
    for block, block_samples in zip(layers, samples, strict=True):
        for (producer_name, linear_names), x in zip(GRID_SITES, block_samples, strict=True):
            linears = [_get(block, name) for name in linear_names]
            s, errors, pick = group_scales(x, torch.cat([m.weight for m in linears]), group)
            for m in linears:
                m.weight.mul_(s.to(m.weight.dtype))
            producer = _get(block, producer_name)
            if isinstance(producer, nn.Linear):  # up_proj: its output rows feed down_proj
                producer.weight.div_(s.to(producer.weight.dtype)[:, None])
                if producer.bias is not None:
                    producer.bias.div_(s.to(producer.bias.dtype))
            else:
                producer.weight.div_(s.to(producer.weight.dtype))
            chosen.append({"site": linear_names[0], "alpha": CANDIDATES[pick][0],
                           "beta": CANDIDATES[pick][1], "error": errors[pick],
                           "error_unscaled": errors[0]})
    return chosen


def sample_stride(rows: int, keep: int = 4096) -> int:
    """Every how many calibration rows the scale search keeps one (about `keep` in all)."""
    return max(1, -(-rows // keep))


def grid_smooth(layers: nn.ModuleList, run: Callable[[torch.Tensor], object],
                windows: list[torch.Tensor], rows: int, group: int) -> dict:
    """Sample the calibration inputs (`rows` in all over `windows`), fold the grid-keeping
    scales in, and return what a record says of them."""
    samples = input_samples(layers, run, windows, stride=sample_stride(rows))
    chosen = grid_smooth_in_place(layers, samples, group)

    def mean(key: str) -> float:
        return sum(c[key] for c in chosen) / len(chosen)

    return {"form": f"grid-keeping: one scale per group of {group} input channels",
            "search": "per layer and site, the (alpha, beta) of a^alpha / w^beta that loses "
                      "least of X W^T under int8 per-token activations",
            "rows_per_site": int(samples[0][0].shape[0]),
            "sites": len(chosen),
            "sites_scaled": sum(1 for c in chosen if (c["alpha"], c["beta"]) != (0.0, 0.0)),
            "local_error_mean": mean("error"), "local_error_unscaled_mean": mean("error_unscaled")}
