"""Real exports of a tiny model to .pte files, run back through executorch.runtime."""

import json
import subprocess
import sys

import pytest

from conftest import tiny_request
from edge_export.pipeline import run
from edge_infer.api import missing_provenance


def test_fp32_export_runs_through_the_cli(tiny_llama, tmp_path, edge_home):
    out = tmp_path / "fp32"
    results = tmp_path / "export.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "edge_infer", "export", str(tiny_llama), "--target",
         "xnnpack-fp32", "--out", str(out), "--corpus", "builtin", "--eval-sequences", "1",
         "--chunk", "8", "--context", "24", "--record", str(results)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xnnpack-fp32 (decoder): SQNR" in proc.stdout
    record = json.loads((out / "record.json").read_text())
    pte = out / record["artifact"]
    assert pte.suffix == ".pte" and pte.stat().st_size == record["size_bytes"] > 10_000
    assert record["measured"] == "pte"
    assert record["sqnr_db"] > 100  # the .pte really ran and matched the HF model
    assert record["wrapper_sqnr_db"] > 100
    assert record["target_sqnr_db"] == 100.0
    for key in ("versions", "machine", "git_commit", "export_s", "eval_s"):
        assert key in record
    assert record["versions"]["executorch"] and record["machine"]["isa"]
    assert missing_provenance(record) == [] and record["guard"] in ("ok", "contended")
    assert record["command"].startswith("python -m edge_infer export ")
    appended = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(appended) == 1 and appended[0]["sqnr_db"] == pytest.approx(record["sqnr_db"])


def test_8da4w_pte_matches_its_eager_quantization(tiny_llama, tmp_path):
    record = run(tiny_request(tiny_llama, "xnnpack-8da4w", tmp_path, unit="block"))
    assert record["measured"] == "pte" and record["unit"] == "block"
    # random weights do not survive 4 bits well; but the score must be a real, finite one,
    # and the .pte must agree with the same quantization run in eager
    assert 5 < record["sqnr_db"] < 60
    assert abs(record["sqnr_db"] - record["eager_sqnr_db"]) < 3
    assert record["group_size"] == 32
    # the 8da4w default: a float offset per group (its linear over group sums lowers too),
    # head at 8 bits, and grid-keeping scales from the calibration windows (never
    # SmoothQuant's per channel ones, which scale the weights off their grid)
    assert record["recipe"]["mapping"] == "float-zero" and record["recipe"]["head_bits"] == 8
    assert record["smooth"]["form"].startswith("grid-keeping")
    assert record["smooth"]["sites"] == 3 and record["calibration"]["samples"] == 4
