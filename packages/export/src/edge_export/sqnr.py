"""Signal-to-quantization-noise ratio of an output against its float reference, in dB.

SQNR = 10 * log10( sum(ref^2) / sum((ref - out)^2) ), summed over every element (all
positions, all vocabulary entries for logits). 20 dB means the error carries 1% of the
signal's energy, 40 dB 0.01%; fp32 rounding differences alone sit above 100 dB.
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
