"""XNNPACK: torch.export -> to_edge_transform_and_lower([XnnpackPartitioner]) -> .pte, and
running a .pte back through executorch.runtime.

Schemes: fp32; 8da4w = int8 dynamic (per token) activations x int4 weights in groups
(torchao Int8DynamicActivationIntxWeightConfig, PerGroup); 8da8w = the same with int8 weights
per output channel. Only nn.Linear layers are quantized; the embedding stays fp32. A `Recipe`
says how: the body's bits and group, and the lm_head's own bits (see HEAD_BITS).
torchao's int4 *weight-only* config lowered to XNNPACK gave wrong output (-44 dB;
docs/DESIGN.md, Export pitfalls), which is why 4-bit here is always the 8da form (weight-only
is an eager ablation form only, edge_export.ablate), and why every variant is scored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

SCHEMES = ("fp32", "8da4w", "8da8w")
MAPPINGS = ("symmetric", "asymmetric", "float-zero")
HEAD = "lm_head"
# 8da4w's lm_head: int8 per output channel, not int4 in groups. The tied head is a fifth of
# smollm2-135m's weights; the 8 bits cost it +14 MiB (see docs/analysis/phone.md).
HEAD_BITS = 8
# 8da4w's body: a float offset per group (Recipe.mapping "float-zero"). On smollm2-135m, whose
# weights sit on a Q4_1 grid, it took the eager SQNR from 9.2 to 23.4 dB and same top from 59%
# to 86% (docs/analysis/phone.md); symmetric rounding re-rounds every weight of such a grid.
BODY_MAPPING = "float-zero"
# SmoothQuant scales folded into the RMSNorms before rounding (edge_export.smooth), or None.
# Off: they scale the weights off the checkpoint's grid, which cost more than the kinder int8
# activations gained (smollm2-135m: 15.4 against 23.4 dB with the float-zero body). Symmetric
# 8da4w without the grid gained from them (9.3 to 10.8 dB); `--ablate` scores both.
SMOOTH_ALPHA: float | None = None
# Grid-keeping scales (edge_export.smooth.grid_smooth_in_place): one scale per group of input
# channels, searched per layer on the calibration windows, folded before the float-zero split.
# They keep the checkpoint's grid, so only the int8 activations change: smollm2-135m went
# from 23.2 to 26.5 dB in eager and 26.0 dB as a .pte (docs/analysis/phone.md). Used when the
# export has calibration windows.
GRID_SMOOTH = True


@dataclass(frozen=True)
class Recipe:
    """How the linear layers are quantized: the body (every linear but the lm_head) and the
    head, each with `bits` (None = left fp32) and a group (0 = one scale per output channel)."""

    body_bits: int | None = 4
    group_size: int = 32
    head_bits: int | None = 4
    head_group_size: int = 0
    # "int8": dynamic per-token int8 activations (the 8da form XNNPACK runs); "float":
    # weight-only, for the eager ablation only (torchao's weight-only int4 lowered to XNNPACK
    # gives wrong output, see the module docstring)
    activations: str = "int8"
    # the body's grid per group: "symmetric" (torchao's, zero at code 0 of the signed range,
    # what XNNPACK's blockwise int4 kernels take); "asymmetric" (torchao's integer zero point
    # per group); "float-zero" (min-max step and a float offset per group, as Q4_1: the
    # offset moves out of the codes into a small linear over group sums, see ZeroShifted)
    mapping: str = "symmetric"

    def __post_init__(self):
        for bits in (self.body_bits, self.head_bits):
            if bits is not None and not 1 <= bits <= 8:
                raise ValueError(f"weight bits must be 1..8 or None (fp32), got {bits}")
        if self.activations not in ("int8", "float"):
            raise ValueError(f"activations must be int8 or float, got {self.activations!r}")
        if self.mapping not in MAPPINGS:
            raise ValueError(f"mapping must be one of {MAPPINGS}, got {self.mapping!r}")
        if self.mapping == "float-zero" and not self.group_size:
            raise ValueError("the float-zero mapping needs a group size")
        if self.group_size < 0 or self.head_group_size < 0:
            raise ValueError("group sizes must be >= 0 (0 = per output channel)")

    def as_record(self) -> dict:
        return asdict(self)


def scheme_recipe(scheme: str, group_size: int, head_bits: int | None = None) -> Recipe:
    """The recipe of an XNNPACK scheme; `head_bits` None = the scheme's default head."""
    if scheme == "8da4w":
        return Recipe(4, group_size, HEAD_BITS if head_bits is None else head_bits,
                      mapping=BODY_MAPPING)
    if scheme == "8da8w":
        return Recipe(8, 0, 8 if head_bits is None else head_bits)
    raise ValueError(f"unknown XNNPACK scheme {scheme!r}")


def _config(bits: int, group_size: int, activations: str, mapping: str = "symmetric"):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.quant_primitives import MappingType

    granularity = PerGroup(group_size) if group_size else PerAxis(0)
    dtype = getattr(torch, f"int{bits}")
    # float-zero: the weights arrive shifted onto a symmetric grid whose step is the group's
    # min-max step, which the no-clipping scale (max(min / qmin, max / qmax)) recovers exactly
    kind = {"symmetric": MappingType.SYMMETRIC, "asymmetric": MappingType.ASYMMETRIC,
            "float-zero": MappingType.SYMMETRIC_NO_CLIPPING_ERR}[mapping]
    if activations == "float":
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity,
                                    mapping_type=kind)
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype,
                                                 weight_granularity=granularity,
                                                 weight_mapping_type=kind)


class ZeroShifted(nn.Module):
    """A linear whose weights w = d (q - z) + c carry a float offset c per (row, group), as a
    Q4_1-style checkpoint's do (d q + min). The codes part is `linear` (symmetric, so the
    quantized kernels take it); the offsets' part, sum_g c_g (sum of x over group g), is a
    linear over the group sums: one float per row and group, 1/group of the weights."""

    def __init__(self, linear: nn.Linear, offsets: torch.Tensor, group: int):
        super().__init__()
        self.linear, self.group = linear, group
        self.offsets = nn.Parameter(offsets, requires_grad=False)  # [out, in / group]
        # the group sums as a linear against ones: XNNPACK delegates it, where a `sum` over
        # the last dim stayed a portable op between two delegates
        self.register_buffer("ones", torch.ones(1, group, dtype=offsets.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = nn.functional.linear(x.unflatten(-1, (-1, self.group)), self.ones).flatten(-2)
        return self.linear(x) + nn.functional.linear(sums, self.offsets)


def shift_to_float_zero(linear: nn.Linear, bits: int, group: int) -> ZeroShifted:
    """Split `linear`'s weights per group into a symmetric grid with the group's min-max step
    d = (max - min) / (2^bits - 1) and a float offset c = min + 2^(bits-1) d. On weights that
    already sit on such a grid (a dequantized Q4_1 checkpoint) the codes then round to the
    checkpoint's own; on others this is min-max asymmetric rounding with a float zero."""
    w = linear.weight.detach().float()
    if w.shape[1] % group:
        raise ValueError(f"in_features {w.shape[1]} is not a multiple of the group {group}")
    g = w.unflatten(1, (-1, group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    offset = lo + 2 ** (bits - 1) * step
    linear.weight.data = (g - offset).flatten(1).to(linear.weight.dtype)
    return ZeroShifted(linear, offset.squeeze(-1).to(linear.weight.dtype), group)


def _shift_body(model: nn.Module, bits: int, group: int) -> None:
    targets = [(fqn, m) for fqn, m in model.named_modules()
               if isinstance(m, nn.Linear) and fqn != HEAD]
    for fqn, linear in targets:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name,
                shift_to_float_zero(linear, bits, group))


def apply_recipe(model: nn.Module, recipe: Recipe) -> None:
    """Quantize `model`'s linear layers in place as `recipe` says (the head is the module
    named HEAD; torchao replaces its weight, so a tied embedding stays fp32)."""
    from torchao.quantization import quantize_
    from torchao.utils import unwrap_tensor_subclass

    if recipe.mapping == "float-zero" and recipe.body_bits is not None:
        _shift_body(model, recipe.body_bits, recipe.group_size)
    parts = ((recipe.body_bits, recipe.group_size, recipe.mapping, lambda fqn: fqn != HEAD),
             (recipe.head_bits, recipe.head_group_size, "symmetric", lambda fqn: fqn == HEAD))
    for bits, group, mapping, wanted in parts:
        if bits is None:
            continue
        quantize_(model, _config(bits, group, recipe.activations, mapping),
                  filter_fn=lambda m, fqn, wanted=wanted: isinstance(m, nn.Linear) and wanted(fqn))
    unwrap_tensor_subclass(model)


def quantize_in_place(model: nn.Module, scheme: str, group_size: int,
                      head_bits: int | None = None) -> Recipe | None:
    """Quantize for `scheme`; returns the recipe that ran (None for fp32)."""
    if scheme == "fp32":
        return None
    recipe = scheme_recipe(scheme, group_size, head_bits)
    apply_recipe(model, recipe)
    return recipe


def to_pte(model: nn.Module, example: tuple) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(model, example)
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return edge.to_executorch().buffer


class PteRunner:
    """A .pte's `forward`, loaded once, callable with the graph's input tuple."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime

        self.method = Runtime.get().load_program(Path(path)).load_method("forward")

    def __call__(self, args: tuple) -> list[torch.Tensor]:
        return self.method.execute(list(args))
