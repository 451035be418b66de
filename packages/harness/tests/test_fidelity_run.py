"""`edge-infer fidelity run` end to end on smollm2-135m, small: 2 chunks of 64 tokens per
corpus, 2 greedy prompts of 6 tokens. A build scored against itself must give KL 0, 100% same
top and exact greedy; a 4-bit build must not."""

import json

import pytest
from harness_cli import cli

from edge_infer.api import missing_provenance


@pytest.fixture(scope="module")
def records(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity") / "fidelity.jsonl"
    res = cli("fidelity", "run", "-m", "smollm2-135m",
              "-b", "llama.cpp:f16,llama.cpp:q4_0,ours:bf16,ours:w4a16",
              "--chunks", "2", "--ctx", "64", "--prompts", "2", "--n-gen", "6",
              "--results", str(out), timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    return {f"{r['engine']}:{r['quant']}": r for r in recs}


def test_every_build_has_a_record(records):
    assert set(records) == {"llama.cpp:f16", "llama.cpp:q4_0", "ours:bf16", "ours:w4a16"}
    for r in records.values():
        assert r["kind"] == "fidelity"
        assert r["positions"] == 2 * 2 * (64 - 1 - 32)  # corpora x chunks x scored rows
        assert set(r["corpora"]) == {"lee", "shakespeare"}
        assert r["source_grid"].startswith("Q4_1")
        assert r["greedy_prompts"] == 2 and len(r["greedy_first_divergence"]) == 2
        assert r["bits_per_weight"] > 0


@pytest.mark.parametrize("build", ["llama.cpp:f16", "ours:bf16"])
def test_a_build_against_itself_is_identical(records, build):
    r = records[build]
    assert r["kl_mean"] < 1e-6, r["kl_mean"]
    assert r["same_top_pct"] == 100.0
    assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert r["greedy_exact"] == 2


@pytest.mark.parametrize("build, base", [("llama.cpp:q4_0", "llama.cpp:f16"),
                                         ("ours:w4a16", "ours:bf16")])
def test_four_bit_builds_differ_from_their_base(records, build, base):
    r = records[build]
    assert r["base"] == base
    assert r["kl_mean"] > 1e-4
    assert r["kl_max"] >= r["kl_p99"] >= r["kl_median"] >= r["kl_min"] >= 0
    assert 50 < r["same_top_pct"] < 100
    assert r["bits_per_weight"] < records[base]["bits_per_weight"] / 2


def test_ours_records_its_kernel(records):
    assert records["ours:w4a16"]["w4_kernels"], "no 4-bit kernel recorded"


def test_report_renders_every_build(records, tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    res = cli("fidelity", "report", "--results", str(path), timeout=120)
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "f.md").read_text()
    for build in ("q4_0", "w4a16", "f16", "bf16"):
        assert f"| {build} |" in md
    assert "Q4_1" in md


def test_unknown_build_is_a_usage_error(smollm2):
    res = cli("fidelity", "run", "-b", "ours:w4a16-g48", "--no-results", timeout=120)
    assert res.returncode == 2
    assert "w4a16" in res.stderr and "g48" in res.stderr


def test_a_second_run_reuses_the_base_logits_and_agrees(records, tmp_path):
    """The base build's log-prob rows and greedy continuations are cached per (weights, token
    ids, prompts): a second run skips the base and scores the same numbers."""
    out = tmp_path / "again.jsonl"
    res = cli("fidelity", "run", "-m", "smollm2-135m", "-b", "ours:w4a16",
              "--chunks", "2", "--ctx", "64", "--prompts", "2", "--n-gen", "6",
              "--results", str(out), timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "base ours:bf16 (cached in" in res.stderr, res.stderr[-3000:]
    again = json.loads(out.read_text().splitlines()[-1])
    first = records["ours:w4a16"]
    for key in ("kl_mean", "same_top_pct", "ppl_ratio", "greedy_exact", "positions"):
        assert again[key] == first[key], key


def test_a_cached_base_is_refused_when_stale_or_truncated(tmp_path):
    from edge_harness.fidelity.chunks import Chunks
    from edge_harness.fidelity.run import cached_base

    chunks = {"lee": Chunks("lee", 8, [[1] * 8, [2] * 8], 100)}
    info = {"chunks": 2, "rows": 8 - 1 - chunks["lee"].first, "vocab": 5,
            "first": chunks["lee"].first}
    (tmp_path / "lee.json").write_text(json.dumps(info))
    data = tmp_path / "lee.f32"
    data.write_bytes(b"\0" * (4 * info["chunks"] * info["rows"] * info["vocab"]))
    key = {"build": "abc", "prompts": [[1, 2]], "n_gen": 4}
    assert cached_base(tmp_path, chunks, key) is None  # no base.json yet
    (tmp_path / "base.json").write_text(json.dumps({**key, "greedy": [[7, 8]]}))
    assert cached_base(tmp_path, chunks, key) == [[7, 8]]
    assert cached_base(tmp_path, chunks, {**key, "build": "other weights"}) is None
    assert cached_base(tmp_path, chunks, {**key, "n_gen": 5}) is None
    data.write_bytes(b"\0" * 12)  # a run killed while writing
    assert cached_base(tmp_path, chunks, key) is None


def test_every_record_carries_its_provenance(records):
    # not timings, so observed rather than guarded: the verdict says what ran beside them
    for label, r in records.items():
        assert missing_provenance(r) == [], label
        assert r["guard"] in ("ok", "contended") and r["command"]
