"""`edge_w4` inside vLLM: a QuantizationConfig and a LinearMethod over our 4-bit kernels.

Checkpoint tensors per quantized linear (all with the output channel on dim 0, so vLLM's
fused QKV / gate-up loaders shard them like plain weights):
    <prefix>.qweight  uint8 [N, K/2]    packed codes (see quant.primitives)
    <prefix>.scales   fp16|bf16 [N, K/group]
    <prefix>.qzeros   uint8 [N, K/group] (zero-point variant only)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from edge_infer.kernels import w4a16
from edge_infer.quant.config import QUANT_METHOD, W4Config
from edge_infer.quant.primitives import SCALE_DTYPES, dequantize_w4, unpack_nibbles

# Under "vllm." so vLLM's own log handler prints it beside its other start-up lines.
log = logging.getLogger("vllm.edge_infer")
_logged_kernels: set[str] = set()


@register_quantization_config(QUANT_METHOD)
class EdgeW4Config(QuantizationConfig):
    def __init__(self, cfg: W4Config) -> None:
        super().__init__()
        self.cfg = cfg

    def __repr__(self) -> str:
        return f"EdgeW4Config({self.cfg})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # CPU method: no GPU capability involved

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # read from config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EdgeW4Config:
        return cls(W4Config.from_hf(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, VocabParallelEmbedding):
            # The LM head and the embedding table (they are one tensor when tied).
            return EdgeW4EmbeddingMethod(self.cfg, prefix) if self.cfg.quantize_lm_head else None
        if isinstance(layer, LinearBase):
            if any(prefix.startswith(p) for p in self.cfg.modules_to_not_convert):
                return UnquantizedLinearMethod()
            return EdgeW4LinearMethod(self.cfg, prefix)
        return None


@register_weight_loader_v2_supported_method
class EdgeW4LinearMethod(LinearMethodBase):
    def __init__(self, cfg: W4Config, prefix: str = "") -> None:
        self.cfg = cfg
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        group = self.cfg.group_size
        k = input_size_per_partition
        n = sum(output_partition_sizes)
        if k % group:
            raise ValueError(
                f"{self.prefix}: in_features {k} is not a multiple of group size {group}"
            )
        loader = extra_weight_attrs["weight_loader"]
        qweight = ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=loader,
        )
        scales = GroupQuantScaleParameter(
            data=torch.empty(n, k // group, dtype=SCALE_DTYPES[self.cfg.scale_dtype]),
            input_dim=1, output_dim=0, weight_loader=loader,
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scales", scales)
        if self.cfg.zero_point:
            qzeros = GroupQuantScaleParameter(
                data=torch.empty(n, k // group, dtype=torch.uint8),
                input_dim=1, output_dim=0, weight_loader=loader,
            )
            layer.register_parameter("qzeros", qzeros)
        layer.w4_params_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        q = unpack_nibbles(layer.qweight.data)
        zero = layer.qzeros.data if self.cfg.zero_point else None
        kernel, layer.w4_packed = w4a16.prepack_checked(
            q, layer.scales.data, zero, self.cfg.group_size, layer.w4_params_dtype, self.cfg.scheme
        )
        layer.w4_kernel = kernel
        # The packed form replaces the checkpoint tensors: keep one copy of the weights.
        del layer.qweight, layer.scales
        if self.cfg.zero_point:
            del layer.qzeros
        if kernel.name not in _logged_kernels:
            _logged_kernels.add(kernel.name)
            log.info("edge_w4 %s: kernel %s (first used by %s)", self.cfg.scheme, kernel.name,
                     self.prefix)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return layer.w4_kernel.forward(x, layer.w4_packed, bias)


class EdgeW4EmbeddingMethod(EdgeW4LinearMethod):
    """4-bit embedding table and LM head (`quantize_lm_head`).

    At small, vocabulary-heavy models the bf16 LM head is most of the bytes read per token
    (SmolLM2-135M: 49152 x 576 of 135M parameters). Embedding lookups dequantize only the
    rows they gather; the LM head runs the same 4-bit kernels as any linear layer. When the
    two are tied they share the loaded codes, and the LM head adds its packed copy.
    """

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs) -> None:
        group = self.cfg.group_size
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % group:
            raise ValueError(f"{self.prefix}: embedding dim {k} is not a multiple of group {group}")
        tensors = {
            "qweight": torch.empty(n, k // 2, dtype=torch.uint8),
            "scales": torch.empty(n, k // group, dtype=SCALE_DTYPES[self.cfg.scale_dtype]),
        }
        if self.cfg.zero_point:
            tensors["qzeros"] = torch.empty(n, k // group, dtype=torch.uint8)
        for name, t in tensors.items():
            param = torch.nn.Parameter(t, requires_grad=False)
            # VocabParallelEmbedding's own loader shards (and zero-pads) along output_dim.
            set_weight_attrs(param, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
            layer.register_parameter(name, param)
        layer.w4_params_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not isinstance(layer, ParallelLMHead):
            return  # the embedding gathers rows straight from the loaded codes
        q = unpack_nibbles(layer.qweight.data)
        zero = layer.qzeros.data if self.cfg.zero_point else None
        layer.w4_kernel, layer.w4_packed = w4a16.prepack_checked(
            q, layer.scales.data, zero, self.cfg.group_size, layer.w4_params_dtype, self.cfg.scheme
        )
        log.info("edge_w4 lm_head: kernel %s", layer.w4_kernel.name)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        rows = unpack_nibbles(layer.qweight.data[input_.reshape(-1)])
        zero = layer.qzeros.data[input_.reshape(-1)] if self.cfg.zero_point else None
        w = dequantize_w4(rows, layer.scales.data[input_.reshape(-1)], zero, self.cfg.group_size)
        return w.to(layer.w4_params_dtype).reshape(*input_.shape, -1)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        for name in ("qweight", "scales", "qzeros"):
            if hasattr(embed_tokens, name):
                setattr(layer, name, getattr(embed_tokens, name))
        return layer
