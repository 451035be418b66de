"""XNNPACK: torch.export -> to_edge_transform_and_lower([XnnpackPartitioner]) -> .pte, and
running a .pte back through executorch.runtime.

Schemes: fp32; 8da4w = int8 dynamic (per token) activations x int4 weights in groups
(torchao Int8DynamicActivationIntxWeightConfig, PerGroup); 8da8w = the same with int8 weights
per output channel. Only nn.Linear layers are quantized (the lm_head too); the embedding stays
fp32. torchao's int4 *weight-only* config lowered to XNNPACK gave wrong output (-44 dB;
docs/DESIGN.md, Export pitfalls), which is why 4-bit here is always the 8da form, and why
every variant is scored.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

SCHEMES = ("fp32", "8da4w", "8da8w")


def quantize_in_place(model: nn.Module, scheme: str, group_size: int) -> None:
    if scheme == "fp32":
        return
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig
    from torchao.utils import unwrap_tensor_subclass

    if scheme == "8da4w":
        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    elif scheme == "8da8w":
        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    else:
        raise ValueError(f"unknown XNNPACK scheme {scheme!r}")
    quantize_(model, config, filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))
    unwrap_tensor_subclass(model)


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
