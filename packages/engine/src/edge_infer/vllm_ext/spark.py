"""Spark-X2.5 (`Spark2_5ForCausalLM`) in vLLM, from vLLM's own layers.

vLLM 0.32 has no implementation; our plugin registers this one (and stands down if vLLM ever
ships its own). The architecture is described in `edge_infer.models.spark_config`. Module
names are the checkpoint's tensor names, so weights load without renaming, and every
projection is one of vLLM's parallel linear layers, so a quantization method (our edge_w4, or
any other) applies to them without special cases. The exception is `g_proj` (hidden -> one
gate per head: 8 or 16 rows): it stays unquantized, as `edge-infer quantize` leaves it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from edge_infer.models.spark_config import Spark2_5Config
from edge_infer.vllm_ext.fused import FusedDecodeMixin

# checkpoint tensor -> (our fused module, shard index)
STACKED = ((".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1))


def _layer_index(prefix: str) -> int:
    return int(prefix.rsplit(".", 1)[-1])


class SparkMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)), exact (erf) GELU as HF's "gelu"."""

    def __init__(self, hidden: int, ffn: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [ffn, ffn], bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            ffn, hidden, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act = GeluAndMul(approximate="none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class SparkAttention(nn.Module):
    def __init__(self, config: Spark2_5Config, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        if total_heads % tp or (total_kv % tp and tp % total_kv):
            raise ValueError(f"{total_heads} heads / {total_kv} KV heads do not split over TP {tp}")
        self.num_heads = total_heads // tp
        self.num_kv_heads = max(1, total_kv // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        # The checkpoint's q_k_v_proj is already fused ([q; k; v] rows): vLLM's QKV loader
        # splits it by head counts when it arrives without a shard id.
        self.q_k_v_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv, bias=config.attention_bias,
            quant_config=quant_config, prefix=f"{prefix}.q_k_v_proj",
        )
        # Head-wise output gate: one logit per head, split over TP like the heads are.
        self.g_proj = ColumnParallelLinear(
            hidden, total_heads, bias=False, quant_config=None, prefix=f"{prefix}.g_proj"
        )
        self.out_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden, bias=config.attention_bias,
            quant_config=quant_config, prefix=f"{prefix}.out_proj",
        )

        layer_type = config.layer_types[_layer_index(prefix.removesuffix(".self_attn"))]
        window = config.sliding_window if layer_type == "sliding_attention" else None
        # NeoX pairing over the first head_dim * partial_rotary_factor dims (llama.cpp: NEOX).
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
            rope_parameters=config.rope_parameters[layer_type],
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            cache_config=cache_config, quant_config=quant_config,
            per_layer_sliding_window=window, prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.q_k_v_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        gate, _ = self.g_proj(x)
        o = o.view(-1, self.num_heads, self.head_dim) * torch.sigmoid(gate).unsqueeze(-1)
        out, _ = self.out_proj(o.view(-1, self.num_heads * self.head_dim))
        return out


class SparkDecoderLayer(nn.Module):
    def __init__(self, config: Spark2_5Config, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = SparkAttention(config, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = SparkMLP(config.hidden_size, config.intermediate_size, quant_config,
                            f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm residual blocks; RMSNorm(x, residual) adds, then normalizes (fused).
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# Compiled mode (a profile or bench run without enforce_eager) traces the decoder stack with
# inductor, as vLLM's own models; without this the class ran eager whatever was asked.
# (dims given: this module's annotations are strings, which the decorator cannot read)
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class SparkModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.embedding = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config,
            prefix=f"{prefix}.embedding",
        )
        self.layers = nn.ModuleList(
            SparkDecoderLayer(config, cache_config, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Spark2_5ForCausalLM(FusedDecodeMixin, nn.Module):
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = SparkModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=_join(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embedding)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        hidden = self.fused_decode(input_ids, positions, intermediate_tensors, inputs_embeds, kwargs)
        if hidden is not None:
            return hidden
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue  # the tied head is the embedding table
            for ckpt, fused, shard in STACKED:
                if ckpt in name:
                    target = name.replace(ckpt, fused)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise KeyError(f"Spark2_5ForCausalLM: checkpoint tensor {name!r} has no "
                                   "parameter to load into (a different architecture?)")
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        # A copy of each head gate's weights for the fused decode path
        # (edge_infer.vllm_ext.fused): on CPU, vLLM repacks an unquantized linear's weight
        # for its own GEMM after loading and empties `weight`.
        for module in self.modules():
            if isinstance(module, SparkAttention):
                module.g_weight = module.g_proj.weight.detach().clone()
        return loaded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
