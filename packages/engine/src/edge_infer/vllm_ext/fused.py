"""The fused decode path: a decode step in one op over the decoder layers.

In a compiled decode step of qwen3-0.6b (docs/results/profile.md) our 4-bit GEMVs took 58%
of the time; most of the rest was dispatch: inductor's wrapper calling ~10 ops per layer
(norms, rope and activation cost microseconds of arithmetic each) and vLLM's attention
wrappers looking the layer up in the forward context. For a step whose requests all decode
one token (`max_query_len == 1`), this path runs every layer in one op, edge_w4::decode_step
(csrc/edge_layer.cpp), each layer as
    attn_in    residual add, RMS norm, QKV GEMV, per-head q/k norm, rope (and a head gate)
    vLLM's own CPU attention ops (its KV-cache write and attention over the cache)
    mlp_out    o_proj GEMV, residual add, RMS norm, gate_up GEMV, activation, down GEMV
eager, with each layer's weights and attention constants handed to C++ once
(edge_w4.DecodeStack): a step crosses from Python into C++ once, where one call per layer
with some fifty arguments cost about as much as the layer's norms and rope. Everything else
stays vLLM's: the scheduler, the KV cache and its layout, attention itself, the final norm,
the LM head and sampling. Prefill and mixed steps, and any model this
path does not cover, run vLLM's (compiled) forward unchanged, which is also the reference the
tests hold this path to.

Covered: vLLM's Llama-family decoder layers (Llama, Qwen2 with its QKV bias, Qwen3 with its
q/k norms) whose linears all run our kernels (edge_w4), bf16 or fp32 activations (fp32 where
the CPU has no bf16 arithmetic, as on AVX2), NeoX rope, SiLU or exact GELU.
`EDGE_INFER_FUSED_DECODE=0` turns it off (the ablation and the reference).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("vllm.edge_infer")
ENV = "EDGE_INFER_FUSED_DECODE"


def enabled() -> bool:
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV}={value!r}: use 1 (on, the default) or 0 (off)")
    return value in ("1", "true", "on")


class Unsupported(Exception):
    """The model has something the fused path does not cover (the reason is the message)."""


@dataclass(frozen=True)
class Linear:
    """One 4-bit linear as the fused ops take it: codes, scales, zero points, meta ints."""

    q: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor | None
    meta: list[int]
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, module: torch.nn.Module, what: str, bias: bool = False) -> Linear:
        """`bias`: the linear may have one (the fused op adds it; only the QKV's takes one)."""
        from edge_infer.kernels.w4a16 import _Edge

        kernel = getattr(module, "w4_kernel", None)
        if kernel is None or not issubclass(kernel, _Edge):
            raise Unsupported(f"{what} does not run an edge_w4 kernel")
        b = getattr(module, "bias", None)
        if b is not None and not bias:
            raise Unsupported(f"{what} has a bias")
        p = module.w4_packed
        return cls(p["q"], p["s"], p["z"], [p["group"], p["layout"], p["isa"], p["small_m_max"],
                                            _Edge.TILE],
                   None if b is None else b.detach().contiguous())


def _norm(module: torch.nn.Module, what: str) -> tuple[torch.Tensor, float]:
    from vllm.model_executor.layers.layernorm import RMSNorm

    if type(module) is not RMSNorm or getattr(module, "variance_size_override", None):
        raise Unsupported(f"{what} is {type(module).__name__}, not a plain RMSNorm")
    return module.weight.detach().float().contiguous(), float(module.variance_epsilon)


def _activation(module: torch.nn.Module) -> int:
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    if type(module) is SiluAndMul:
        return 0
    if type(module) is GeluAndMul and getattr(module, "approximate", "none") == "none":
        return 1
    raise Unsupported(f"activation {type(module).__name__}")


def _first(module: torch.nn.Module, *names: str) -> torch.nn.Module:
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise Unsupported(f"{type(module).__name__} has none of {names}")


@dataclass
class Layer:
    ln1: torch.Tensor
    eps1: float
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    head_eps: float
    cos_sin: torch.Tensor
    rot: int
    attn: Any  # vLLM's Attention layer
    name: str
    isa: str
    scale: float
    softcap: float
    window: int
    alibi: torch.Tensor | None
    k_scale: float
    v_scale: float
    o: Linear
    ln2: torch.Tensor
    eps2: float
    gate_up: Linear
    down: Linear
    act: int
    gate_w: torch.Tensor | None  # per-head output gate (Spark-X2.5's g_proj), [nq, H]

    @classmethod
    def of(cls, layer: torch.nn.Module, i: int, tables: dict[int, torch.Tensor],
           dtype: torch.dtype, attention: bool = True) -> Layer:
        """Layer i's weights and attention constants; `tables` holds the rope tables made so
        far, one per rope object (vLLM shares them between layers); `dtype` is the
        activations'."""
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        sa, mlp = layer.self_attn, layer.mlp
        # vLLM's Llama-family names, or our Spark-X2.5's (edge_infer.vllm_ext.spark)
        qkv_proj = _first(sa, "qkv_proj", "q_k_v_proj")
        o_proj = _first(sa, "o_proj", "out_proj")
        act_fn = _first(mlp, "act_fn", "act")
        attn = sa.attn
        gate_w = None
        if hasattr(sa, "g_proj"):
            # our Spark-X2.5 class keeps a copy of the weights (vLLM repacks the linear's own)
            gate_w = getattr(sa, "g_weight", None)
            if getattr(sa.g_proj, "bias", None) is not None or gate_w is None \
                    or gate_w.dtype != dtype:
                raise Unsupported(f"layer {i}: the head gate is not a {dtype} linear without bias")
            gate_w = gate_w.contiguous()
            if gate_w.shape != (attn.num_heads, layer.input_layernorm.weight.shape[0]):
                raise Unsupported(f"layer {i}: head gate of shape {tuple(gate_w.shape)}")
        if type(attn.impl).__name__ != "CPUAttentionBackendImpl":
            raise Unsupported(f"layer {i}: attention backend {type(attn.impl).__name__}")
        impl = attn.impl
        if attn.head_size != attn.head_size_v or attn.query_quant is not None:
            raise Unsupported(f"layer {i}: attention with a different V size or quantized queries")
        if (impl.attn_type != "decoder" or impl.kv_cache_dtype != "auto" or impl.sinks is not None
                or impl.kv_sharing_target_layer_name is not None
                or (attention and not hasattr(attn, "isa"))):
            raise Unsupported(f"layer {i}: attention other than decoder self-attention over a "
                              f"cache in the activations' dtype")
        rope = sa.rotary_emb
        if not (isinstance(rope, RotaryEmbedding) and rope.is_neox_style
                and type(rope).forward_native is RotaryEmbedding.forward_native):
            raise Unsupported(f"layer {i}: rotary embedding {type(rope).__name__}")
        q_norm = k_norm = None
        head_eps = 1e-6
        if hasattr(sa, "q_norm"):
            q_norm, head_eps = _norm(sa.q_norm, f"layer {i} q_norm")
            k_norm, _ = _norm(sa.k_norm, f"layer {i} k_norm")
        ln1, eps1 = _norm(layer.input_layernorm, f"layer {i} input_layernorm")
        ln2, eps2 = _norm(layer.post_attention_layernorm, f"layer {i} post_attention_layernorm")
        # the eager model ropes in the activations' dtype with the table rounded to it
        cos_sin = tables.get(id(rope))
        if cos_sin is None:
            cos_sin = tables[id(rope)] = rope.cos_sin_cache.to(dtype).float().contiguous()
        qkv = Linear.of(qkv_proj, f"layer {i} qkv_proj", bias=True)
        if qkv.bias is not None and qkv.bias.dtype != dtype:
            raise Unsupported(f"layer {i}: the QKV bias is {qkv.bias.dtype}, not {dtype}")
        return cls(ln1, eps1, qkv, q_norm, k_norm,
                   head_eps, cos_sin, int(rope.rotary_dim), attn, attn.layer_name,
                   getattr(attn, "isa", ""),
                   impl.scale, float(impl.logits_soft_cap), int(impl.sliding_window),
                   impl.alibi_slopes, float(attn._k_scale_float), float(attn._v_scale_float),
                   Linear.of(o_proj, f"layer {i} o_proj"), ln2, eps2,
                   Linear.of(mlp.gate_up_proj, f"layer {i} gate_up_proj"),
                   Linear.of(mlp.down_proj, f"layer {i} down_proj"), _activation(act_fn), gate_w)


class FusedDecode:
    def __init__(self, inner: torch.nn.Module, layers: list[Layer], dtype: torch.dtype) -> None:
        self.inner = inner
        self.layers = layers
        self.dtype = dtype
        a = layers[0].attn
        self.nq, self.nkv, self.d = a.num_heads, a.num_kv_heads, a.head_size
        self.q_size, self.kv_size = self.nq * self.d, self.nkv * self.d
        self.steps = 0  # decode steps run here (the tests check the path was taken)
        self.names = [lay.name for lay in layers]
        self.stack = None  # edge_w4.DecodeStack: every layer's constants, given once
        self.groups = 0  # KV-cache groups in the last step (sliding-window layers make a second)

    def _stack(self) -> Any:
        """The layers' constants in C++ (edge_w4.DecodeStack), so that a step is one op call
        rather than one per layer with some fifty arguments converted each time."""
        stack = torch.classes.edge_w4.DecodeStack()
        for lay in self.layers:
            stack.add(lay.ln1, lay.eps1, lay.qkv.q, lay.qkv.s, lay.qkv.z, lay.qkv.meta, lay.q_norm,
                      lay.k_norm, lay.head_eps, lay.cos_sin, lay.rot, lay.gate_w, lay.qkv.bias,
                      lay.isa, lay.k_scale, lay.v_scale, lay.scale, lay.alibi, lay.window,
                      lay.softcap, lay.o.q, lay.o.s, lay.o.z, lay.o.meta, lay.ln2, lay.eps2,
                      lay.gate_up.q, lay.gate_up.s, lay.gate_up.z, lay.gate_up.meta,
                      lay.down.q, lay.down.s, lay.down.z, lay.down.meta, lay.act)
        return stack

    @classmethod
    def build(cls, model: torch.nn.Module, attention: bool = True) -> FusedDecode:
        """The fused path for a vLLM `*ForCausalLM`, or Unsupported saying why not
        (`attention=False`: without the checks that need the attention backend set up)."""
        from edge_infer.kernels import ops

        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "norm"):
            raise Unsupported(f"{type(model).__name__} has no decoder-layer stack")
        if getattr(inner, "aux_hidden_state_layers", ()):
            raise Unsupported("auxiliary hidden states (speculative decoding) are requested")
        if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
            raise Unsupported("pipeline parallelism")
        dtype = getattr(getattr(inner.norm, "weight", None), "dtype", None)
        if dtype not in (torch.bfloat16, torch.float32):
            raise Unsupported(f"activations are {dtype}; the fused ops take bf16 or fp32")
        ops.load()
        tables: dict[int, torch.Tensor] = {}
        built = cls(inner, [Layer.of(layer, i, tables, dtype, attention)
                            for i, layer in enumerate(layers)], dtype)
        if any(lay.attn.num_heads != built.nq or lay.attn.num_kv_heads != built.nkv
               or lay.attn.head_size != built.d for lay in built.layers):
            raise Unsupported("layers differ in head counts")
        if attention:
            built.stack = built._stack()
        return built

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor | None:
        """The hidden states after the final norm, or None when this step is not all decode."""
        metas = ctx.attn_metadata
        first = metas.get(self.layers[0].name)
        if first is None or first.max_query_len != 1:
            return None
        slots = ctx.slot_mapping
        residual = self.inner.embed_input_ids(input_ids)
        if residual.dtype != self.dtype:
            return None
        residual = residual.reshape(-1, residual.shape[-1]).clone()
        positions = positions.reshape(-1)
        # the layers' KV-cache groups (one metadata and slot mapping each, e.g. sliding-window
        # and full-attention layers) are told apart by the objects vLLM hands each layer
        firsts: list[str] = []
        group: list[int] = []
        seen: dict[tuple[int, int], int] = {}
        for n in self.names:
            g = seen.setdefault((id(metas[n]), id(slots[n])), len(firsts))
            if g == len(firsts):
                firsts.append(n)
            group.append(g)
        gm = [metas[n] for n in firsts]
        self.groups = len(gm)
        x = torch.ops.edge_w4.decode_step(
            self.stack, residual, positions, self.nq, self.nkv, self.d,
            [lay.attn.kv_cache for lay in self.layers], group, [slots[n] for n in firsts],
            [m.query_start_loc for m in gm], [m.seq_lens for m in gm],
            [int(m.causal) for m in gm], [m.block_table for m in gm],
            [m.scheduler_metadata for m in gm], [m.dynamic_causal for m in gm],
            [m.num_actual_tokens for m in gm])
        hidden, _ = self.inner.norm(x, residual)
        self.steps += 1
        return hidden


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fused path would not run this model (None: it would), checked on the weights
    alone, as at load; the attention checks wait for the first step."""
    if not isinstance(model, FusedDecodeMixin):
        return f"{type(model).__name__} is not a class with the fused path"
    try:
        FusedDecode.build(model, attention=False)
    except Unsupported as why:
        return str(why)
    return None


_UNSET = object()


class FusedDecodeMixin:
    """Put before a vLLM `*ForCausalLM` in the bases: decode-only steps take FusedDecode. A
    class with its own forward calls `fused_decode` first instead."""

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        hidden = self.fused_decode(input_ids, positions, intermediate_tensors, inputs_embeds,
                                   kwargs)
        if hidden is not None:
            return hidden
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def fused_decode(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                     kwargs) -> torch.Tensor | None:
        """This step's hidden states from FusedDecode, or None: run the model's own forward."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        # a step with attention metadata (not a warm-up or profiling run, which have none)
        ctx = get_forward_context() if is_forward_context_available() else None
        if ctx is None or not isinstance(ctx.attn_metadata, dict) or not ctx.attn_metadata:
            return None
        # built at the first such step: the attention backend sets up its layers (isa) then
        fused = self.__dict__.get("_edge_fused", _UNSET)
        if fused is _UNSET:
            fused = None
            if enabled():
                try:
                    fused = FusedDecode.build(self)
                    log.info("edge-infer fused decode: on (%d layers)", len(fused.layers))
                except Unsupported as why:
                    log.info("edge-infer fused decode: off (%s)", why)
            self.__dict__["_edge_fused"] = fused
        if fused is None or intermediate_tensors is not None or inputs_embeds is not None or kwargs:
            return None
        return fused.forward(input_ids, positions, ctx)


def _subclass(module: str, name: str) -> type:
    import importlib

    base = getattr(importlib.import_module(module), name)
    return type(name, (FusedDecodeMixin, base), {"__module__": __name__, "__doc__": base.__doc__})


def __getattr__(name: str) -> type:
    """`Qwen3ForCausalLM` etc.: vLLM's class with the fused decode path, made on first use (the
    registry imports it lazily, by "module:class")."""
    if name in WRAPPED:
        cls = _subclass(WRAPPED[name], name)
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# vLLM architecture -> the vLLM module that implements it
WRAPPED = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}
