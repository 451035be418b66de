"""The plugin inside vLLM: checkpoint -> vLLM load == quantizing the same weights in memory."""

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edge_infer import profiles
from edge_infer.kernels import w4a16
from edge_infer.quant.checkpoint import load_tensors, quantize_checkpoint, quantize_tensors
from edge_infer.quant.config import W4Config
from edge_infer.quant.primitives import dequantize_w4, unpack_nibbles
from edge_infer.serve.resolve import Resolved
from edge_infer.serve.runtime import vllm_env

CONFIGS = {
    "g64": W4Config(group_size=64),
    # zero points, fp16 scales, and the tied LM head / embedding table in 4 bits too
    "g32-zp-head": W4Config(group_size=32, zero_point=True, scale_dtype="fp16",
                            quantize_lm_head=True),
    # int8 activations: the same stored codes, another kernel path
    "w4a8-g64": W4Config(scheme="w4a8", group_size=64),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def cfg(request) -> W4Config:
    return CONFIGS[request.param]


@pytest.fixture(scope="module")
def checkpoint(smollm2, tmp_path_factory, cfg) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "smollm2-w4a16"
    report = quantize_checkpoint(smollm2.hf_dir, out, cfg)
    assert report.quantized == 30 * 7 + int(cfg.quantize_lm_head)  # tied: one vocab tensor
    return out


@pytest.fixture(scope="module")
def llm(checkpoint, monkeypatch_module):
    from edge_infer.serve.offline import make_llm

    prof = profiles.load("smollm2-135m")
    for k, v in vllm_env(prof).items():
        monkeypatch_module.setenv(k, v)
    engine = make_llm(Resolved(checkpoint, "w4", prof), prefix_caching=False, max_model_len=256)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def probe_layers(model):
    """Inside vLLM: every edge_w4 layer's kernel name and its output on a fixed input."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "w4_packed") and name not in out:
            k = mod.w4_packed.get("k") or mod.w4_packed["w"].shape[1]
            x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
            out[name] = (mod.w4_kernel.name, mod.w4_kernel.forward(x, mod.w4_packed, None))
    return out


def test_config_names_our_method(checkpoint, cfg):
    qc = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "edge_w4" and W4Config.from_hf(qc) == cfg


def test_bits_per_weight_from_file_sizes(checkpoint, cfg):
    st = next(checkpoint.glob("*.safetensors"))
    q_bytes = n_weights = 0
    with safe_open(st, "pt") as f:
        for name in f.keys():
            if name.endswith((".qweight", ".scales", ".qzeros")):
                shape = f.get_slice(name).get_shape()
                q_bytes += shape[0] * shape[1] * (2 if name.endswith(".scales") else 1)
                if name.endswith(".qweight"):
                    n_weights += shape[0] * shape[1] * 2
    expected = cfg.bits_per_weight(64, 1024)  # per weight it does not depend on the shape
    assert 8 * q_bytes / n_weights == pytest.approx(expected)
    report = json.loads((checkpoint / "edge_infer_quant.json").read_text())
    assert report["linear_bits_per_weight"] == pytest.approx(expected)
    # the whole model is more where the vocabulary tensor or the norms stay bf16
    assert expected < report["model_bits_per_weight"] < 16


def test_vllm_layers_equal_in_memory_quantization(llm, smollm2, cfg):
    (probed,) = llm.apply_model(probe_layers)
    # qkv, o, gate_up, down per layer (+ the LM head)
    assert len(probed) == 30 * 4 + int(cfg.quantize_lm_head)
    memory = quantize_tensors(load_tensors(smollm2.hf_dir), cfg)
    for name, (kernel_name, y) in probed.items():
        if name == "lm_head":  # tied: the LM head is the embedding table
            parts = ["model.embed_tokens"]
        else:
            prefix, leaf = name.rsplit(".", 1)
            parts = [f"{prefix}.{p}" for p in FUSED.get(leaf, (leaf,))]
        q = unpack_nibbles(torch.cat([memory[f"{p}.qweight"] for p in parts]))
        s = torch.cat([memory[f"{p}.scales"] for p in parts])
        z = torch.cat([memory[f"{p}.qzeros"] for p in parts]) if cfg.zero_point else None
        g = cfg.group_size
        kernel = w4a16.select(q.shape[0], q.shape[1], g, scheme=cfg.scheme)
        assert kernel.name == kernel_name
        x = torch.randn(2, q.shape[1], generator=torch.Generator().manual_seed(q.shape[1]))
        packed = kernel.prepack(q, s, z, g, torch.bfloat16, cfg.scheme)
        ref = kernel.forward(x.to(torch.bfloat16), packed, None)
        assert torch.equal(y, ref), f"{name}: vLLM-loaded weights differ from in-memory ones"


def test_logits_match_torch_reference(llm, smollm2, cfg):
    """vLLM's prompt logprobs vs a plain fp32 torch model carrying the dequantized weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32)
    memory = quantize_tensors(load_tensors(smollm2.hf_dir), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied: lm_head is embed_tokens here
            prefix = name.removesuffix(".weight")
            if f"{prefix}.qweight" in memory:
                q = unpack_nibbles(memory[f"{prefix}.qweight"])
                z = memory.get(f"{prefix}.qzeros")
                param.copy_(dequantize_w4(q, memory[f"{prefix}.scales"], z, cfg.group_size))
        if cfg.scheme == "w4a8":  # the same int8 rounding of every quantized layer's input
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and f"{name}.qweight" in memory:
                    mod.register_forward_pre_hook(
                        lambda _m, args: (w4a16.quantize_activations(args[0], cfg.group_size),))
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    (out,) = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
    agree, diffs = 0, []
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]  # logprobs of token `pos` given tokens < pos
        top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
        agree += int(top == int(ref[pos - 1].argmax()))
        diffs.append(abs(entry[ids[pos]].logprob - float(ref[pos - 1, ids[pos]])))
    # bf16 activations in vLLM vs fp32 here: close, not bit-equal. With int8 activations the
    # bf16/fp32 difference also moves values across rounding boundaries, so w4a8 drifts more.
    floor, ceiling = (0.8, 0.3) if cfg.scheme == "w4a8" else (0.9, 0.15)
    print(f"{cfg.scheme}: top-1 {agree}/{len(ids) - 1}, mean |dlogprob| {sum(diffs) / len(diffs):.3f}")
    assert agree / (len(ids) - 1) >= floor
    assert sum(diffs) / len(diffs) < ceiling, diffs

