"""Every runner produces sane records on tiny settings (no speed is asserted)."""

import json

import pytest
from harness_cli import cli

from edge_harness.bench.weights import gguf_build_facts, gguf_tensors, safetensors_tensors
from edge_harness.record import read_records
from edge_infer.api import missing_provenance

TINY = ("-p", "16", "-n", "4", "-r", "1", "--no-ceiling", "--force", "--window", "0.2")


def run_bench(tmp_path, engines: str, *extra: str) -> list:
    results = tmp_path / "bench.jsonl"
    res = cli("bench", "run", "-m", "smollm2-135m", "-e", engines, *TINY, *extra,
              "--results", str(results), "-o", "json")
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout)
    records = read_records(results)
    assert [r["test"] for r in printed] == [r.test for r in records]
    return records


def check_sane(records, engine: str, quant: str, threads: int):
    mine = [r for r in records if r.engine == engine and r.quant == quant]
    assert {r.test for r in mine} == {"pp16", "tg4"}
    for r in mine:
        assert len(r.samples) == 1 and r.samples[0] > 0 and r.median == r.samples[0]
        assert r.threads == threads and len(r.cores) == threads
        assert r.extra["facts"]["threads"] == threads
        assert r.extra["facts"]["cores"] == r.cores
        assert not r.extra["facts"]["prefix_caching"]
        assert r.guard in ("ok", "overridden")
        assert r.cpu_model and r.isa and r.engine_version
        assert missing_provenance(r.to_dict()) == []
        assert r.timestamp and r.run_id
        assert 0 < r.bits_per_weight < 33
    tg = next(r for r in mine if r.test == "tg4")
    assert tg.weight_bytes_per_token > 0
    assert tg.achieved_gbs == pytest.approx(tg.weight_bytes_per_token * tg.median / 1e9, rel=1e-2)
    return mine


def test_llama_cpp_on_smollm2_gguf(tmp_path, smollm2, edge_home):
    records = run_bench(tmp_path, "llama.cpp:original", "-t", "1")
    (pp, tg) = sorted(check_sane(records, "llama.cpp", "original", 1), key=lambda r: r.test)
    assert pp.n_prompt == 16 and tg.n_gen == 4
    assert pp.extra["facts"]["flash_attn"] == "on"
    assert "llama-cpp-python 0.3.36" in pp.engine_version
    # the published Q4_1 GGUF: 4 bits + fp16 scale and min per 32 -> ~5 bits/weight and more
    assert 4.5 < pp.bits_per_weight < 7


def test_gguf_builds_from_the_hf_folder(smollm2, edge_home):
    """HF -> BF16 GGUF (vendored converter) -> Q4_0 (llama_model_quantize), same tensors."""
    from edge_harness.runners.base import ModelRef
    from edge_harness.runners.llamacpp import LlamaCppRunner

    model = ModelRef("smollm2-135m", smollm2.hf_dir, smollm2.gguf_path)
    q4 = LlamaCppRunner.prepare(model, "q4_0")
    bf16_path = edge_home / "harness" / "gguf" / "smollm2-135m-bf16.gguf"
    bf16 = gguf_tensors(bf16_path)
    hf = safetensors_tensors(smollm2.hf_dir)
    params = sum(n for _, n in hf.values())
    assert sum(n for _, n in bf16.values()) == params  # every weight, nothing added
    assert gguf_build_facts(bf16_path, params)[0] == pytest.approx(16.0, abs=0.1)
    assert 4.0 < q4.bits_per_weight < 7.0  # Q4_0 with q5_0/q8_0 fallbacks where 576 % 256
    assert q4.weight_bytes_per_token < params  # under a byte per weight


def test_torch_and_ours_on_smollm2(tmp_path, smollm2, edge_home):
    """One interleaved run of the floor and our engine (bf16 and our 4-bit build)."""
    records = run_bench(tmp_path, "torch:bf16,ours:bf16,ours:w4a16")
    threads = len(records[0].cores)
    check_sane(records, "torch", "bf16", threads)
    bf16 = check_sane(records, "ours", "bf16", threads)
    w4 = check_sane(records, "ours", "w4a16", threads)
    # 4-bit builds run vLLM's compiled mode by default, the bf16 reference eager
    assert not any(r.extra["facts"]["enforce_eager"] for r in w4)
    assert all(r.extra["facts"]["enforce_eager"] for r in bf16)
    assert all(sum(r.extra["facts"]["w4_kernels"].values()) == 30 * 4 for r in w4)  # 30 layers
    assert all("vllm 0.32.0" in r.engine_version for r in w4)
    bf16_bits = next(r for r in records if r.quant == "bf16" and r.engine == "ours").bits_per_weight
    assert w4[0].bits_per_weight < bf16_bits


@pytest.mark.parametrize(("fused", "op", "per_token"), [
    # the fused decode path: one op per layer. Its ops take bf16, and "auto" runs fp32 on a
    # CPU without bf16 arithmetic (AVX2), where the path is off: bf16 is asked for, so the
    # case runs the fused path on every CPU
    ("@act_dtype=bfloat16", "edge_w4::decode_layer", 30),
    ("@fused=0", "edge_w4::linear", 30 * 4),  # qkv, o, gate_up, down in each of 30 layers
], ids=["fused", "unfused"])
def test_profile_splits_a_decode_step_of_ours(tmp_path, smollm2, edge_home, fused, op, per_token):
    """`bench profile`: our kernels show up by name, once per layer (fused) or per quantized
    linear (unfused) every decode step (+ the warm-up outside the profile)."""
    results = tmp_path / "profile.jsonl"
    batch = 2 if op.endswith("decode_layer") else 1  # the fused path also decodes a batch per step
    # --force, as the other CLI tests here: the guard judges a shared test machine (the
    # previous case's processes may still be winding down); the profile is what is tested
    res = cli("bench", "profile", "-m", "smollm2-135m", "-e", f"ours:w4a8{fused}", "-n", "4",
              "-b", str(batch), "--results", str(results), "--force")
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert rec["kind"] == "profile" and rec["quant"] == "w4a8" and rec["step_ms"] > 0
    assert missing_provenance(rec) == []
    assert rec["batch"] == batch and rec["options"].get("max_num_seqs") == batch
    assert 0 < rec["in_ops_s"] <= rec["wall_s"]
    ours = {o["op"]: o for o in rec["ops"] if o["op"].startswith("edge_w4::")}
    assert ours[op]["calls"] >= per_token * rec["tokens"], sorted(ours)
    assert "our 4-bit kernels" in res.stdout
    if not op.endswith("decode_layer"):
        return
    assert rec["fused_decode"] == "on"
    assert "### smollm2-135m, ours:w4a8" in res.stdout
    bad = cli("bench", "profile", "-m", "smollm2-135m", "-e", "llama.cpp:q4_0", "--no-results")
    assert bad.returncode != 0 and "llama.cpp has no op profiler" in bad.stderr
