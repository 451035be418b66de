"""What gets exported: a decoder with a static KV cache and a finite attention mask.

One graph, fixed shapes, no integer arithmetic inside: every call takes `chunk` new tokens and
a past cache of `context - chunk` slots, and returns the logits of the new tokens and their
keys/values. The host owns the cache (it writes the returned keys/values into the next call's
past), the rotary tables and the mask, so the graph holds no `arange`, no position arithmetic
and no mutable buffer. That matters because:
  - the XNNPACK quantizer breaks integer `arange` index nodes in HF models (docs/DESIGN.md, Export pitfalls);
  - QNN/AI Hub want plain inputs and outputs, not mutable buffers;
  - the mask is *finite* (MASK_VALUE) and additive: HF's ~-3.4e38 (or -65535) mask makes the
    16-bit activation range of `scores + mask` so wide that real scores all round to one code.

Inputs of `StaticDecoder.forward` (B = 1):
    tokens  int32 [1, T]            the T new tokens
    cos,sin f32   [T, head_dim]     rotary tables at the new tokens' positions
    mask    f32   [T, P + T]        0 where a query may attend, the decoder's mask_value
                                    elsewhere (MASK_VALUE, or FLOAT_MASK_VALUE for XNNPACK)
    k_past  f32   [L, Hkv, P, D]    past keys (after RoPE), slots in position order
    v_past  f32   [L, Hkv, P, D]
Outputs: logits f32 [1, T, V], k_new f32 [L, Hkv, T, D], v_new f32 [L, Hkv, T, D].

`BlockUnit` is one transformer block with the same conventions: the quick unit to export.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edge_infer.api import UsageError

# For graphs whose activations are quantized per tensor (QNN's 16-bit): exp(-64) ~ 1.6e-28, so
# a masked key weighs nothing in fp32 while its raw score is under ~30 above the row's best,
# and the range of `scores + mask` stays ~100 wide (16-bit step ~0.002).
MASK_VALUE = -64.0
# For graphs whose attention runs in float (XNNPACK: only the linears are quantized). -64 is
# not enough there on every model: qwen2.5-coder-0.5b's raw scores (q/k biases) put masked
# keys (the chunk's later tokens, the empty cache slots) far enough above the allowed ones that
# its fp32 static decoder scored 39 dB against HF with -64, and 97 dB with -1e4 (2 windows).
# -3e4 is far past any raw score and still a finite half-precision number.
FLOAT_MASK_VALUE = -3.0e4

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class StaticShape:
    """The fixed shapes of an exported graph: `chunk` new tokens over a `context` window."""

    chunk: int = 32
    context: int = 128

    def __post_init__(self):
        if not 0 < self.chunk <= self.context:
            raise UsageError(f"need 0 < chunk <= context, got chunk {self.chunk}, "
                             f"context {self.context}")

    @property
    def past(self) -> int:
        return self.context - self.chunk


NORM_FORMS = ("fused", "xnnpack")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str,
             eps_t: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim in one of two graph forms with the same math.

    "fused" keeps one `aten.rms_norm` node: QnnQuantizer then quantizes only its input and
    output (QNN has an RmsNorm op), never x*x, whose range is the square of the outliers'.
    "xnnpack" spells it with ops XNNPACK delegates: its partitioner takes `mean.dim` only over
    dims [2, 3] of a 4D tensor, and `add.Tensor` but not `add.Scalar`, while the fused node
    decomposes into a 3D mean and an add.Scalar. Every undelegated node splits the graph
    into more XNNPACK partitions, each lowered (slowly) and called on its own.
    """
    if form == "fused":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    shape = x.shape
    mean_sq = (x * x).reshape(-1, 1, shape[-1], 1).mean(dim=(2, 3), keepdim=True)
    # eps as a [1] buffer (`eps_t`), so the add is add.Tensor; torch.full here would be a node
    return x * torch.rsqrt(mean_sq.reshape(*shape[:-1], 1) + eps_t) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Block(nn.Module):
    """One pre-norm decoder block reading the weights of an HF block (shared, not copied)."""

    def __init__(self, hf_layer: nn.Module, n_heads: int, n_kv: int, head_dim: int, eps: float,
                 norm_form: str):
        super().__init__()
        self.norm_form = norm_form
        attn = hf_layer.self_attn
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3
        self.k_norm = getattr(attn, "k_norm", None)
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.mlp = hf_layer.mlp
        self.n_heads, self.n_kv, self.head_dim, self.eps = n_heads, n_kv, head_dim, eps
        self.register_buffer("eps_t", torch.tensor([eps]), persistent=False)
        self.scale = head_dim ** -0.5

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, norm.weight, self.eps, self.norm_form, self.eps_t)

    def forward(self, x, cos, sin, mask, k_past, v_past):
        # x [1, T, H]; k_past/v_past [Hkv, P, D]
        t = x.shape[1]
        h = self._norm(self.input_layernorm, x)
        q = self.q_proj(h).view(t, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(h).view(t, self.n_kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(h).view(t, self.n_kv, self.head_dim).transpose(0, 1)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm.weight, self.eps, self.norm_form, self.eps_t)
            k = rms_norm(k, self.k_norm.weight, self.eps, self.norm_form, self.eps_t)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys = torch.cat((k_past, k), dim=1)  # [Hkv, P+T, D]
        values = torch.cat((v_past, v), dim=1)
        # Grouped-query attention without repeating K/V: the `group` query heads that share a
        # KV head go through one bmm ([Hkv, group*T, D] @ [Hkv, D, P+T]). bmm, not matmul:
        # matmul exports as expand + bmm, and XNNPACK does not delegate expand_copy.
        group, s = self.n_heads // self.n_kv, keys.shape[1]
        q = q.reshape(self.n_kv, group * t, self.head_dim) * self.scale
        scores = torch.bmm(q, keys.transpose(1, 2)).view(self.n_kv, group, t, s) + mask
        probs = torch.softmax(scores, dim=-1).view(self.n_kv, group * t, s)
        out = torch.bmm(probs, values).view(self.n_heads, t, self.head_dim)
        out = out.transpose(0, 1).reshape(1, t, self.n_heads * self.head_dim)
        x = x + self.o_proj(out)
        x = x + self.mlp(self._norm(self.post_attention_layernorm, x))
        return x, k, v


def _arch_facts(hf_model: nn.Module) -> dict:
    cfg = hf_model.config
    arch = (getattr(cfg, "architectures", None) or [type(hf_model).__name__])[0]
    if arch not in SUPPORTED:
        raise UsageError(f"cannot export architecture {arch!r}; supported: {', '.join(SUPPORTED)}")
    heads = cfg.num_attention_heads
    return {
        "arch": arch,
        "n_heads": heads,
        "n_kv": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "eps": cfg.rms_norm_eps,
        "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size,
        "hidden": cfg.hidden_size,
    }


class StaticDecoder(nn.Module):
    """The whole decoder (embedding to logits) over HF weights, in the static form above."""

    def __init__(self, hf_model: nn.Module, norm_form: str = "fused",
                 mask_value: float = MASK_VALUE):
        super().__init__()
        facts = _arch_facts(hf_model)
        self.norm_form = norm_form
        self.mask_value = mask_value  # what the host writes into the mask (chunk_inputs)
        self.facts = facts
        body = hf_model.model
        self.embed_tokens = body.embed_tokens
        self.layers = nn.ModuleList(
            _Block(layer, facts["n_heads"], facts["n_kv"], facts["head_dim"], facts["eps"],
                   norm_form)
            for layer in body.layers
        )
        self.norm = body.norm
        self.register_buffer("eps_t", torch.tensor([facts["eps"]]), persistent=False)
        self.lm_head = hf_model.lm_head
        self._rotary = body.rotary_emb

    def forward(self, tokens, cos, sin, mask, k_past, v_past):
        x = self.embed_tokens(tokens)
        new_k, new_v = [], []
        per_layer = k_past.shape[1:]
        for i, layer in enumerate(self.layers):
            # a slice, not k_past[i]: XNNPACK delegates slice_copy but not select_copy
            x, k, v = layer(x, cos, sin, mask, k_past[i:i + 1].reshape(per_layer),
                            v_past[i:i + 1].reshape(per_layer))
            new_k.append(k)
            new_v.append(v)
        x = rms_norm(x, self.norm.weight, self.facts["eps"], self.norm_form, self.eps_t)
        out_shape = (len(new_k), *k.shape)  # cat + view: XNNPACK delegates both, not stack
        return (self.lm_head(x), torch.cat(new_k).view(out_shape),
                torch.cat(new_v).view(out_shape))

    def cache_shape(self, slots: int) -> tuple[int, ...]:
        f = self.facts
        return (f["layers"], f["n_kv"], slots, f["head_dim"])

    def first_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the graph's first input is for these tokens: the tokens themselves."""
        return tokens.to(torch.int32)

    @torch.no_grad()
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] from the HF model's own rotary module (its scaling included)."""
        probe = torch.zeros(1, dtype=torch.float32)
        cos, sin = self._rotary(probe, positions.view(1, -1))
        return cos[0].float(), sin[0].float()


class BlockUnit(nn.Module):
    """Transformer block `index` alone: hidden states in, hidden states and new K/V out."""

    def __init__(self, decoder: StaticDecoder, index: int = 0):
        super().__init__()
        self.block = decoder.layers[index]
        self.facts = dict(decoder.facts, layers=1)
        self.mask_value = decoder.mask_value
        self._decoder = [decoder]  # a list: not a submodule, so it is not exported twice

    def forward(self, hidden, cos, sin, mask, k_past, v_past):
        per_layer = k_past.shape[1:]
        x, k, v = self.block(hidden, cos, sin, mask, k_past.reshape(per_layer),
                             v_past.reshape(per_layer))
        return x, k.view(1, *k.shape), v.view(1, *v.shape)

    def rope(self, positions):
        return self._decoder[0].rope(positions)

    def cache_shape(self, slots: int) -> tuple[int, ...]:
        f = self.facts
        return (1, f["n_kv"], slots, f["head_dim"])

    @torch.no_grad()
    def first_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """Real hidden states for the block: the embeddings of these tokens."""
        return self._decoder[0].embed_tokens(tokens.to(torch.int32)).float()


# ---- the host side: cache management around any callable with the graph's signature ----

Step = Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]


def chunk_inputs(model, shape: StaticShape, first, start: int, k_cache, v_cache):
    """The inputs of one call: `first` holds the chunk (tokens or hidden states) starting at
    absolute position `start`; the caches hold `start` valid slots of `shape.past`."""
    t, p = shape.chunk, shape.past
    positions = torch.arange(start, start + t)
    cos, sin = model.rope(positions)
    return (first, cos, sin, chunk_mask(t, p, start, model.mask_value), k_cache, v_cache)


def chunk_mask(t: int, past: int, start: int, masked: float) -> torch.Tensor:
    """The additive mask [t, past + t] of a call whose cache holds `start` valid slots of
    `past`: 0 where a new token may attend, `masked` elsewhere."""
    mask = torch.full((t, past + t), masked)
    mask[:, :start] = 0.0  # every valid past slot is earlier than every new token
    mask[:, past:] = torch.triu(torch.full((t, t), masked), diagonal=1)
    return mask


@dataclass(frozen=True)
class SinkPrefix:
    """The keys/values of a fixed first token (BOS), computed once in fp32 and given to every
    sequence as its initial cache: the attention-sink token's massive activations (smollm2:
    ~25000 in one channel of the residual stream at position 0, against a median of 2-12;
    measured) then never pass through the quantized graph, whose 16-bit per-tensor ranges
    they would otherwise set (step ~0.4). Deployments ship it as a constant next to the graph.
    """

    tokens: torch.Tensor  # [1, p]
    k: torch.Tensor  # [L, Hkv, p, D]
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@torch.no_grad()
def sink_prefix(model, token_id: int) -> SinkPrefix:
    """Run `model` (float, eager; before any in-place quantization) on the one-token prefix."""
    tokens = torch.tensor([[token_id]])
    cos, sin = model.rope(torch.arange(1))
    empty = torch.zeros(model.cache_shape(0))
    _, k, v = model(model.first_input(tokens), cos, sin, torch.zeros(1, 1), empty, empty)
    return SinkPrefix(tokens, k.detach().clone(), v.detach().clone())


def window_tokens(shape: StaticShape, prefix: SinkPrefix | None) -> int:
    """The longest multiple of `chunk` that fits the context after the prefix."""
    free = shape.context - (prefix.length if prefix else 0)
    return (free // shape.chunk) * shape.chunk


def run_sequence(model, step: Step, shape: StaticShape, tokens: torch.Tensor,
                 prefix: SinkPrefix | None = None) -> torch.Tensor:
    """Feed `tokens` [1, n*chunk] through `step` chunk by chunk, carrying the KV cache on the
    host (starting from `prefix`'s keys/values when given); returns the first output (logits,
    or the block's hidden states) of all chunks."""
    first = model.first_input(tokens)
    n = first.shape[1]
    offset = prefix.length if prefix else 0
    if n % shape.chunk or offset + n > shape.context:
        raise ValueError(f"sequence of {n} (+{offset} prefix) is not a multiple of chunk "
                         f"{shape.chunk} within context {shape.context}")
    k_cache = torch.zeros(model.cache_shape(shape.past))
    v_cache = torch.zeros_like(k_cache)
    if prefix:
        k_cache[:, :, :offset] = prefix.k
        v_cache[:, :, :offset] = prefix.v
    outs = []
    for start in range(0, n, shape.chunk):
        piece = first[:, start:start + shape.chunk]
        pos = offset + start
        args = chunk_inputs(model, shape, piece, pos, k_cache, v_cache)
        result = step(args)
        outs.append(result[0].detach().clone())
        if start + shape.chunk < n:  # write the new keys/values into the next slots
            k_cache = k_cache.clone()
            v_cache = v_cache.clone()
            k_cache[:, :, pos:pos + shape.chunk] = result[1]
            v_cache[:, :, pos:pos + shape.chunk] = result[2]
    return torch.cat(outs, dim=1)


def example_inputs(model, shape: StaticShape) -> tuple[torch.Tensor, ...]:
    """Inputs of the right shapes and dtypes for tracing (the first chunk of a sequence)."""
    first = model.first_input(torch.zeros(1, shape.chunk, dtype=torch.int32))
    cache = torch.zeros(model.cache_shape(shape.past))
    return chunk_inputs(model, shape, first, 0, cache, cache.clone())


INPUT_NAMES = ("tokens", "cos", "sin", "mask", "k_past", "v_past")
OUTPUT_NAMES = ("logits", "k_new", "v_new")
