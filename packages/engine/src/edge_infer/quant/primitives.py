"""4-bit group quantization primitives: tensor in, tensor out, nothing hidden.

Conventions (every kernel and the checkpoint format share them):
- a weight is [N, K] (out_features, in_features), grouped along K in groups of `group`;
- `q` holds unsigned codes 0..15 (uint8, one code per byte until packed);
- symmetric:  w ~= (q - 8) * scale                (scale [N, K/group])
- zero point: w ~= (q - zero) * scale             (zero uint8 0..15, [N, K/group])
- the scale is rounded to its storage dtype *before* codes are computed, so the codes are
  optimal for the scale that is actually stored;
- packed nibbles: byte j of a row holds k=2j in its low nibble and k=2j+1 in its high one.
"""

from __future__ import annotations

import torch

SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_groupable(shape: tuple[int, int], group: int, name: str = "weight") -> None:
    n, k = shape
    if k % group:
        raise ValueError(
            f"{name}: in_features {k} is not a multiple of the group size {group}; "
            f"choose a group that divides {k} (e.g. {_largest_group(k)})"
        )
    if k % 2:
        raise ValueError(f"{name}: in_features {k} is odd; 4-bit packing needs pairs")


def _largest_group(k: int) -> int:
    for g in (128, 64, 32, 16):
        if k % g == 0:
            return g
    return 0


def quantize_w4(
    w: torch.Tensor, group: int, zero_point: bool, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] float -> (q uint8 [N, K], scale [N, K/group], zero uint8 [N, K/group] or None)."""
    check_groupable(tuple(w.shape), group)
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if zero_point:
        lo = g.amin(-1).clamp(max=0)
        hi = g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(scale_dtype)
        s = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
        zero = (-lo / s).round().clamp(0, 15)
        q = (g / s[..., None] + zero[..., None]).round().clamp(0, 15)
        return q.to(torch.uint8).reshape(n, k), scale, zero.to(torch.uint8)
    # Symmetric: the signed extreme maps to code -8, so all 16 levels are in use
    # (the same choice as llama.cpp's Q4_0).
    idx = g.abs().argmax(-1, keepdim=True)
    extreme = g.gather(-1, idx).squeeze(-1)
    scale = (extreme / -8).to(scale_dtype)
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (g / s[..., None]).round().clamp(-8, 7) + 8
    return q.to(torch.uint8).reshape(n, k), scale, None


def dequantize_w4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """The reference meaning of the codes, in fp32: [N, K]."""
    n, k = q.shape
    qg = q.reshape(n, k // group, group).float()
    z = zero.float() if zero is not None else torch.full(scale.shape, 8.0)
    return ((qg - z[..., None]) * scale.float()[..., None]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> uint8 [N, K/2]."""
    return (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out
