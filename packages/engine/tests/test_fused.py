"""The fused decode path (edge_infer.vllm_ext.fused, csrc/edge_layer.cpp).

The ops are held to the same layer written with plain torch around the same 4-bit linear (so a
difference is the fusion's, not the kernel's); inside vLLM, the tokens a fused decode step
scores are held to the scores of the unfused (prefill) forward on the same tokens."""

import gc

import pytest
import torch
import torch.nn.functional as F

from edge_infer.kernels import w4a16
from edge_infer.quant.primitives import quantize_w4


def linear(bits, x):
    return bits["kernel"].forward(x, bits["p"], None)


def make_linear(n, k, group, gen, dtype):
    q, s, z = quantize_w4(torch.randn(n, k, generator=gen) * 0.05, group, False)
    kernel, p = w4a16.prepack_checked(q, s, z, group, dtype)
    if not issubclass(kernel, w4a16._Edge):
        pytest.skip(f"our kernels do not run a [{n}, {k}] layer here ({kernel.name} does)")
    meta = [p["group"], p["layout"], p["isa"], p["small_m_max"], w4a16._Edge.TILE]
    return {"kernel": kernel, "p": p, "args": (p["q"], p["s"], p["z"], meta)}


def rms(x, w, eps):
    dtype, x = x.dtype, x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)


def rope(x, cos, sin, rot):
    """NeoX rope over the first `rot` dims of [M, heads, d]; cos/sin [M, rot/2]."""
    dtype, x = x.dtype, x.float()
    half = rot // 2
    a, b, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, rest], -1).to(dtype)


CASES = {  # hidden, heads, kv heads, head dim, rotary dim, ffn, group, q/k norm, gate, act, rows,
    # qkv bias
    "qwen3-like": (256, 4, 2, 64, 64, 384, 64, True, False, 0, 1, False),
    "qwen2-like": (256, 4, 2, 64, 64, 384, 64, False, False, 0, 2, True),
    "smollm2-like": (192, 3, 1, 64, 64, 320, 64, False, False, 0, 3, False),
    "spark-like": (256, 2, 1, 128, 64, 384, 128, False, True, 1, 2, False),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    return CASES[request.param]


# bf16 where the CPU multiplies bf16; fp32 on AVX2, which does not (the profile rule's choice)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_ops_match_torch(case, dtype):
    from edge_infer.kernels import ops

    ops.load()
    hidden, nq, nkv, d, rot, ffn, group, qk_norm, gated, act, m, biased = case
    gen = torch.Generator().manual_seed(hidden + nq + act)
    qkv = make_linear((nq + 2 * nkv) * d, hidden, group, gen, dtype)
    o = make_linear(hidden, nq * d, group, gen, dtype)
    gate_up = make_linear(2 * ffn, hidden, group, gen, dtype)
    down = make_linear(hidden, ffn, group, gen, dtype)
    ln1, ln2 = (1 + 0.1 * torch.randn(hidden, generator=gen) for _ in range(2))
    qn = (1 + 0.1 * torch.randn(d, generator=gen)) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=gen)) if qk_norm else None
    gate_w = (0.05 * torch.randn(nq, hidden, generator=gen)).to(dtype) if gated else None
    cos_sin = torch.randn(64, rot, generator=gen).to(dtype).float()
    positions = torch.randint(0, 64, (m,), generator=gen)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    residual = torch.randn(m, hidden, generator=gen).to(dtype)
    attn = torch.randn(m, nq * d, generator=gen).to(dtype)
    # Qwen2's QKV bias is large beside its GEMV's output (what the fused op must not drop)
    bias = torch.randn((nq + 2 * nkv) * d, generator=gen).to(dtype) if biased else None

    # attn_in, in place on a copy of the residual
    res = residual.clone()
    got_qkv, got_gates = torch.ops.edge_w4.attn_in(
        res, x, ln1, 1e-6, *qkv["args"], qn, kn, 1e-6, cos_sin, positions, nq, nkv, d, rot,
        gate_w, bias)
    want_res = (residual.float() + x.float()).to(dtype)
    assert res.dtype == got_qkv.dtype == dtype and torch.equal(res, want_res)
    h = rms(want_res, ln1, 1e-6)
    y = qkv["kernel"].forward(h, qkv["p"], bias)
    q = y[:, : nq * d].view(m, nq, d)
    k = y[:, nq * d : (nq + nkv) * d].view(m, nkv, d)
    if qk_norm:
        q, k = rms(q, qn, 1e-6), rms(k, kn, 1e-6)
    cos, sin = cos_sin[positions, : rot // 2], cos_sin[positions, rot // 2 :]
    want_qkv = torch.cat([rope(q, cos, sin, rot).reshape(m, -1), rope(k, cos, sin, rot).reshape(m, -1),
                          y[:, (nq + nkv) * d :]], -1)
    err = (got_qkv.float() - want_qkv.float()).abs().max() / want_qkv.float().abs().max()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert got_qkv.shape == want_qkv.shape and err < tol, f"qkv relative error {err:.2e}"
    if gated:
        want_gates = torch.sigmoid(F.linear(h, gate_w).float())
        assert got_gates.shape == (m, nq)
        assert (got_gates.float() - want_gates).abs().max() < 1e-2
    else:
        assert got_gates.numel() == 0

    # mlp_out, in place on another copy
    res = residual.clone()
    heads = got_gates if gated else None
    got = torch.ops.edge_w4.mlp_out(res, attn, *o["args"], ln2, 1e-6, *gate_up["args"],
                                    *down["args"], act, heads)
    a_in = attn if not gated else (attn.view(m, nq, d) * got_gates[:, :, None]).reshape(m, -1)
    want_res = (residual.float() + linear(o, a_in).float()).to(dtype)
    assert (res.float() - want_res.float()).abs().max() <= 1e-2 * want_res.float().abs().max()
    gu = linear(gate_up, rms(res, ln2, 1e-6)).float()
    g, u = gu[:, :ffn], gu[:, ffn:]
    fn = F.silu(g) if act == 0 else F.gelu(g)
    want = linear(down, (fn.to(dtype).float() * u).to(dtype))
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert got.shape == (m, hidden) and got.dtype == dtype, (got.shape, got.dtype)
    # bf16 rounds at the same places in both; fp32 differs only in summation order
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"mlp_out relative error {err:.2e}"


def test_decode_step_refuses_what_does_not_fit_its_stack():
    """edge_w4::decode_step takes one cache per layer of its DecodeStack and each metadata list
    once per KV-cache group: a mismatch is one line, not a read past a list."""
    from edge_infer.kernels import ops

    ops.load()
    stack = torch.classes.edge_w4.DecodeStack()
    t, res = torch.zeros(4), torch.zeros(1, 4, dtype=torch.bfloat16)

    def step(caches, group, per_group):
        return torch.ops.edge_w4.decode_step(
            stack, res, t, 1, 1, 4, caches, group, [t] * per_group, [t] * per_group,
            [t] * per_group, [1] * per_group, [t] * per_group, [t] * per_group,
            [None] * per_group, [1] * per_group)

    with pytest.raises(RuntimeError, match="over no layers"):
        step([], [], 1)
    # one layer's constants (decode_step checks the lists before it reads any of them)
    stack.add(t, 1e-6, t, t, None, [64, 2, 0, 8, 32], None, None, 1e-6, t, 4, None, None, "",
              1.0, 1.0, 1.0, None, -1, 0.0, t, t, None, [64, 2, 0, 8, 32], t, 1e-6, t, t, None,
              [64, 2, 0, 8, 32], t, t, None, [64, 2, 0, 8, 32], 0)
    assert stack.size() == 1
    with pytest.raises(RuntimeError, match="got 0 caches and 0 group indices for 1 layers"):
        step([], [], 1)
    with pytest.raises(RuntimeError, match="once per KV-cache group"):
        torch.ops.edge_w4.decode_step(stack, res, t, 1, 1, 4, [t], [0], [t], [], [t], [1], [t],
                                      [t], [None], [1])
    with pytest.raises(RuntimeError, match="group 1 is out of range"):
        step([t], [1], 1)


# -- inside vLLM --------------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_decode_scores_like_the_unfused_forward(smollm2, tmp_path, monkeypatch, dtype):
    """Greedy decode through the fused path, then the same tokens scored as one prompt by
    the model's own forward: the log-probability of each generated token must agree (bf16
    rounds at other places in the two; a wrong layer costs nats). fp32 is the activation
    dtype on CPUs without bf16 arithmetic (AVX2)."""
    from conftest import decode_against_scoring
    from edge_infer import profiles
    from edge_infer.quant.checkpoint import quantize_checkpoint
    from edge_infer.quant.config import W4Config
    from edge_infer.serve.offline import make_llm
    from edge_infer.serve.resolve import Resolved
    from edge_infer.serve.runtime import vllm_env

    prof = profiles.load("smollm2-135m")
    for k, v in vllm_env(prof).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDGE_INFER_FUSED_DECODE", "1")
    checkpoint = tmp_path / "w4"
    quantize_checkpoint(smollm2.hf_dir, checkpoint, W4Config(group_size=64))
    engine = make_llm(Resolved(checkpoint, "w4", prof), prefix_caching=False, max_model_len=256,
                      enforce_eager=True, dtype=dtype)
    try:
        ids = engine.get_tokenizer()(PROMPT)["input_ids"]
        diffs, steps = decode_against_scoring(engine, ids, 24)
        assert steps >= 23  # every step after the prompt's
        # measured in bf16: 0.03 mean (the compiled unfused decode: 0.02); in fp32 the two
        # forwards differ only in summation order: 5e-6 mean, 3e-5 at most
        mean, worst = (0.1, 0.5) if dtype == "bfloat16" else (1e-3, 1e-2)
        assert sum(diffs) / len(diffs) < mean and max(diffs) < worst, diffs
    finally:
        del engine
        gc.collect()


def test_fused_decode_adds_the_qkv_bias(tmp_path, monkeypatch):
    """A Qwen2 layer has a QKV bias (qwen2.5-coder's is large beside its GEMV's output): the
    fused path takes the layer and its decode scores like the unfused forward in fp32, the
    AVX2 dtype. A tiny random Qwen2 with biases of std 1, so a dropped bias costs nats."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from conftest import decode_against_scoring
    from edge_infer import profiles
    from edge_infer.quant.checkpoint import quantize_checkpoint
    from edge_infer.quant.config import W4Config
    from edge_infer.serve.offline import make_llm
    from edge_infer.serve.resolve import Resolved
    from edge_infer.serve.runtime import vllm_env
    from edge_infer.testing import tiny_bpe_tokenizer

    hf = tmp_path / "hf"
    tok = tiny_bpe_tokenizer(hf)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0, 1)
    model.eval().save_pretrained(hf)

    prof = profiles.load("smollm2-135m")
    for k, v in vllm_env(prof).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDGE_INFER_FUSED_DECODE", "1")
    checkpoint = tmp_path / "w4"
    quantize_checkpoint(hf, checkpoint, W4Config(group_size=64))
    engine = make_llm(Resolved(checkpoint, "w4", prof), prefix_caching=False, max_model_len=256,
                      enforce_eager=True, dtype="float32")
    try:
        ids = tok(PROMPT)["input_ids"]
        diffs, steps = decode_against_scoring(engine, ids, 16)
        (has_bias,) = engine.apply_model(
            lambda m: all(lay.qkv.bias is not None for lay in m.__dict__["_edge_fused"].layers))
        assert has_bias and steps >= 15, (has_bias, steps)
        assert sum(diffs) / len(diffs) < 1e-3 and max(diffs) < 1e-2, diffs
    finally:
        del engine
        gc.collect()
