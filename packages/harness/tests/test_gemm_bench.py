"""The GEMM microbenchmark's measuring side on a tiny config (speed itself is not asserted)."""

import json

import pytest
from harness_cli import cli

from edge_harness.bench import gemm
from edge_harness.record import read_records
from edge_infer.api import missing_provenance
from edge_infer.kernels import w4a16

TINY = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 192}


def test_linear_shapes_follow_vllm_fusion():
    shapes = gemm.linear_shapes(TINY)
    assert shapes == {"qkv_proj": (256, 128), "o_proj": (128, 128), "gate_up_proj": (384, 128),
                      "down_proj": (128, 192)}
    assert gemm.linear_shapes(TINY | {"vocab_size": 1000})["lm_head"] == (1000, 128)


def test_measure_times_every_scheme_of_every_kernel(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setattr(gemm, "cold_bytes", lambda: 1 << 20)
    names = [k for k in ("edge-avx2", "edge-portable", "tinygemm") if w4a16.KERNELS[k].available()]
    if not names:
        pytest.skip("no 4-bit kernel builds here")
    rows = gemm.measure("tiny", str(tmp_path), 64, threads=1, min_time=0.0, ms=[1, 3, 128],
                        kernels=names)
    seen = {(r["impl"], r["quant"]) for r in rows}
    for name in names:
        for scheme in w4a16.KERNELS[name].schemes:
            assert (name, scheme) in seen
    assert {("F.linear", "bf16"), ("F.linear", "fp32")} <= seen
    for r in rows:
        assert r["m"] in (1, 3, 128) and all(s > 0 for s in r["seconds"]) and r["weight_bytes"] > 0
        # a (batched) decode call streams copies of the weights, not one cached copy; a
        # prefill-sized one runs on one warm copy
        assert r["copies"] > 1 if r["m"] <= gemm.DECODE_M_MAX else r["copies"] == 1
    # our kernels are also timed from a C++ loop of calls, at decode-sized M only
    timings = {(r["impl"], r["quant"], r["m"], r["timing"]) for r in rows}
    for name in names:
        looped = hasattr(w4a16.KERNELS[name], "loop_seconds")
        for scheme in w4a16.KERNELS[name].schemes:
            assert {(name, scheme, m, "op") for m in (1, 3, 128)} <= timings
            assert ((name, scheme, 1, "loop") in timings) == looped
            assert (name, scheme, 128, "loop") not in timings
    assert not any(t[0] == "F.linear" and t[3] == "loop" for t in timings)


def test_region_cost_is_measured_per_thread_count():
    if not w4a16.ext.available():
        pytest.skip("C++ kernels could not be built here")
    us = gemm.region_cost(1, reps=200, samples=3)
    assert len(us) == 3 and all(0 <= u < 1e4 for u in us)


def test_dispatched_times_only_the_kernel_the_engine_picks(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setattr(gemm, "cold_bytes", lambda: 1 << 20)
    rows = gemm.measure("tiny", str(tmp_path), 64, threads=1, min_time=0.0, ms=[1],
                        kernels=[gemm.DISPATCHED])
    for layer, (n, k) in gemm.linear_shapes(TINY).items():
        want = {(w4a16.select(n, k, 64, scheme=s).name, s) for s in w4a16.SCHEMES}
        got = {(r["impl"], r["quant"]) for r in rows
               if r["layer"] == layer and r["impl"] != "F.linear"}
        assert got == want


def test_every_gemm_record_carries_its_provenance(tmp_path, smollm2, edge_home):
    """`bench gemm` end to end, as small as it goes: the parallel-region, dot-peak and GEMM
    records each say where, how and beside what they were timed."""
    results = tmp_path / "bench.jsonl"
    res = cli("bench", "gemm", "-m", "smollm2-135m", "--m-sizes", "1", "--kernels",
              gemm.DISPATCHED, "--min-time", "0.01", "--no-ceiling", "--force",
              "--window", "0.2", "--results", str(results), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_records(results, kind=None)
    assert {"parallel_region", "dot_peak"} <= {r.test for r in records}
    assert any(r.test.startswith("gemm_m1_") for r in records)
    for r in records:
        assert missing_provenance(r.to_dict()) == [], r.test
