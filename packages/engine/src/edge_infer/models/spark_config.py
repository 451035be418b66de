"""The transformers config of Spark-X2.5 (`model_type: spark2_5`), so its config.json loads
with AutoConfig and no remote code (transformers 5.19 does not know the architecture).

Defaults are the published 1.7B shapes. The architecture, in one place:
- layers repeat [sliding, sliding, sliding, full]; sliding layers see the last `sliding_window`
  positions (the current one included), full layers see everything before them;
- RoPE per layer type (NeoX pairing, first `head_dim * partial_rotary_factor` dims rotated):
  full attention theta 5e6 with factor 0.25, sliding attention theta 1e4 with factor 1.0;
- one fused `q_k_v_proj` ([q; k; v] rows), no q/k norms, a head-wise sigmoid output gate
  `g_proj` (hidden -> heads) scaling each head's attention output before `out_proj`;
- gated GELU MLP (gelu(gate) * up, exact erf GELU), RMSNorm (x * w), tied embeddings.
"""

from __future__ import annotations

from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig

from edge_infer.models.registry import (
    SPARK_LAYER_PATTERN,
    spark_layer_types,
    spark_rope_parameters,
)

MODEL_TYPE = "spark2_5"


@strict
class Spark2_5Config(PreTrainedConfig):
    model_type: ClassVar[str] = MODEL_TYPE
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    vocab_size: int = 131072
    hidden_size: int = 2048
    intermediate_size: int = 6656
    num_hidden_layers: int = 28
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "gelu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    headwise_attn_output_gate: bool = True
    gate_attn_act_mode: str = "sigmoid"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = spark_layer_types(self.num_hidden_layers)
        if self.rope_parameters is None:
            self.rope_parameters = spark_rope_parameters()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation: what our implementations assume."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - set(SPARK_LAYER_PATTERN)
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        missing = set(self.layer_types) - set(self.rope_parameters)
        if missing:
            raise ValueError(f"rope_parameters has no entry for layer types {sorted(missing)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads are not a multiple of "
                             f"{self.num_key_value_heads} KV heads")
        if not self.headwise_attn_output_gate or self.gate_attn_act_mode != "sigmoid":
            raise ValueError("only the head-wise sigmoid attention output gate is implemented")
        if self.hidden_act != "gelu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only 'gelu' is implemented")


def register() -> None:
    """Make AutoConfig know `spark2_5` (idempotent; safe in every process)."""
    try:
        AutoConfig.register(MODEL_TYPE, Spark2_5Config)
    except ValueError:
        pass  # already registered (by us, or by a transformers release that ships it)


register()
