"""Signal-to-quantization-noise ratio of an output against its float reference, in dB.

SQNR = 10 * log10( sum(ref^2) / sum((ref - out)^2) ), summed over every element (all
positions, all vocabulary entries for logits). 20 dB means the error carries 1% of the
signal's energy, 40 dB 0.01%; fp32 rounding differences alone sit above 100 dB.

`logit_agreement` gives the harness's fidelity metrics over the same logits, so an export row
and an engine row can be read side by side: same top (argmax agrees, % of positions) and
KL(P_ref || P_out) per position, averaged (llama-perplexity's definitions, in float64).
"""

from __future__ import annotations

import math

import torch


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """SQNR of `out` against `ref` (same shape); +inf when they are identical."""
    if ref.shape != out.shape:
        raise ValueError(f"shapes differ: reference {tuple(ref.shape)}, output {tuple(out.shape)}")
    ref64 = ref.detach().to(torch.float64)
    err = ref64 - out.detach().to(torch.float64)
    signal = float(ref64.square().sum())
    noise = float(err.square().sum())
    if not math.isfinite(noise):
        return float("-inf")  # a NaN/inf output is no signal at all
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def logit_agreement(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """same_top_pct and kl_mean of `out` against `ref` (logits [..., V], same shape)."""
    if ref.shape != out.shape:
        raise ValueError(f"shapes differ: reference {tuple(ref.shape)}, output {tuple(out.shape)}")
    r = torch.log_softmax(ref.detach().reshape(-1, ref.shape[-1]).double(), dim=-1)
    o = torch.log_softmax(out.detach().reshape(-1, out.shape[-1]).double(), dim=-1)
    kl = (r.exp() * (r - o)).sum(-1)
    same = (r.argmax(-1) == o.argmax(-1)).double()
    return {"same_top_pct": 100.0 * float(same.mean()), "kl_mean": float(kl.mean())}
