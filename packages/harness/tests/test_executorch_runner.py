"""ExecuTorch as an engine: a tiny model's .pte (XNNPACK) through bench run, and the .pte's
logits against the HF model's through the runner's own cache handling (no speed asserted)."""

import json
import os

import pytest
from harness_cli import cli

from edge_harness.record import read_records
from edge_infer.api import missing_provenance

pytest.importorskip("edge_export", reason="the executorch engine needs edge-infer-export")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved as an HF folder (no tokenizer: ids below its vocab)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("et") / "tiny-llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def test_bench_run_times_both_builds(tmp_path, tiny, edge_home):
    results = tmp_path / "bench.jsonl"
    # pp100: not a multiple of the 128-token prefill chunk, so the last chunk is padded
    res = cli("bench", "run", "-m", str(tiny), "-e", "executorch:fp32,executorch:8da4w",
              "-p", "100", "-n", "4", "-r", "1", "-t", "1", "--no-ceiling", "--force",
              "--window", "0.2", "--results", str(results), "-o", "json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["test"] for r in json.loads(res.stdout)] == [r.test for r in read_records(results)]
    records = read_records(results)
    assert {(r.quant, r.test) for r in records} == {
        (q, t) for q in ("fp32", "8da4w") for t in ("pp100", "tg4")}
    for r in records:
        assert r.engine == "executorch" and r.samples[0] > 0
        facts = r.extra["facts"]
        assert facts["threads"] == 1 and facts["static_context"] == 512
        assert facts["act_dtype"] == ("float32" if r.quant == "fp32" else
                                      "int8 (dynamic, per token)")
        assert "executorch 1.4.1 (XNNPACK" in r.engine_version
        assert missing_provenance(r.to_dict()) == []
        assert r.weight_bytes_per_token > 0
    bits = {r.quant: r.bits_per_weight for r in records}
    assert bits["8da4w"] < bits["fp32"] / 2  # int4 body, int8 head


def test_the_pte_computes_the_models_logits(tiny, edge_home):
    """Prefill 128 tokens, then one decode step on the cache the host carried over: both
    match the HF model's own logits (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from edge_harness.bench.run import resolve_model
    from edge_harness.runners.executorch import ExecuTorchRunner

    model = resolve_model(str(tiny))
    build = ExecuTorchRunner.prepare(model, "fp32")
    runner = ExecuTorchRunner()
    runner.load(build, 1, 512)
    ids = torch.randint(0, 256, (129,), generator=torch.Generator().manual_seed(1)).tolist()
    k, v = runner._cache("prefill"), runner._cache("prefill")
    logits, k_new, v_new = runner._call("prefill", ids[:128], 0, k, v)
    kd, vd = runner._cache("decode"), runner._cache("decode")
    kd[:, :, :128], vd[:, :, :128] = k_new, v_new
    step, _, _ = runner._call("decode", ids[128:], 128, kd, vd)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits[0], ref[:128], atol=1e-4, rtol=1e-4)
    assert torch.allclose(step[0, 0], ref[128], atol=1e-4, rtol=1e-4)
    # a second prepare finds the cached .pte: no new export
    mtime = os.stat(build.path).st_mtime_ns
    assert ExecuTorchRunner.prepare(model, "fp32").path == build.path
    assert os.stat(build.path).st_mtime_ns == mtime
    with pytest.raises(ValueError, match="static context of 512 slots; this run needs 513"):
        ExecuTorchRunner().load(build, 1, 513)
