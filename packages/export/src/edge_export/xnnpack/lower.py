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
HEAD = "lm_head"
# 8da4w's lm_head: int8 per output channel, not int4 in groups. The tied head is a fifth of
# smollm2-135m's weights; the 8 bits cost it +14 MiB (see docs/analysis/phone.md).
HEAD_BITS = 8
# 8da4w first folds SmoothQuant scales (alpha 0.5) from the calibration windows' activations
# into the RMSNorms (edge_export.smooth); `--calibration 0` skips it. On smollm2-135m it took
# the eager KL from 0.37 to 0.28 and SQNR from 9.3 to 10.9 dB (docs/analysis/phone.md).
SMOOTH_ALPHA: float | None = 0.5


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

    def __post_init__(self):
        for bits in (self.body_bits, self.head_bits):
            if bits is not None and not 1 <= bits <= 8:
                raise ValueError(f"weight bits must be 1..8 or None (fp32), got {bits}")
        if self.activations not in ("int8", "float"):
            raise ValueError(f"activations must be int8 or float, got {self.activations!r}")
        if self.group_size < 0 or self.head_group_size < 0:
            raise ValueError("group sizes must be >= 0 (0 = per output channel)")

    def as_record(self) -> dict:
        return asdict(self)


def scheme_recipe(scheme: str, group_size: int, head_bits: int | None = None) -> Recipe:
    """The recipe of an XNNPACK scheme; `head_bits` None = the scheme's default head."""
    if scheme == "8da4w":
        return Recipe(4, group_size, HEAD_BITS if head_bits is None else head_bits)
    if scheme == "8da8w":
        return Recipe(8, 0, 8 if head_bits is None else head_bits)
    raise ValueError(f"unknown XNNPACK scheme {scheme!r}")


def _config(bits: int, group_size: int, activations: str):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
    )

    granularity = PerGroup(group_size) if group_size else PerAxis(0)
    dtype = getattr(torch, f"int{bits}")
    if activations == "float":
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity)
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype,
                                                 weight_granularity=granularity)


def apply_recipe(model: nn.Module, recipe: Recipe) -> None:
    """Quantize `model`'s linear layers in place as `recipe` says (the head is the module
    named HEAD; torchao replaces its weight, so a tied embedding stays fp32)."""
    from torchao.quantization import quantize_
    from torchao.utils import unwrap_tensor_subclass

    parts = ((recipe.body_bits, recipe.group_size, lambda fqn: fqn != HEAD),
             (recipe.head_bits, recipe.head_group_size, lambda fqn: fqn == HEAD))
    for bits, group, wanted in parts:
        if bits is None:
            continue
        quantize_(model, _config(bits, group, recipe.activations),
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
