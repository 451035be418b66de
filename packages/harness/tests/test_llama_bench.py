"""`edge-infer bench crosscheck`'s pieces that need no llama.cpp build: llama-bench's JSON,
the verdict, the record kind kept out of the speed tables, and the tools build's cache check.
The real llama-bench beside our runner runs in slow_tests (nox -s fidelity-crosscheck)."""

import json

import pytest

from edge_harness.bench import crosscheck, llama_tools
from edge_harness.record import Record, append_record, read_records
from edge_infer.errors import EdgeInferError


def entry(**kw):
    # The fields llama-bench -o json prints that the crosscheck reads (values made up).
    e = {"build_commit": "abc1234", "build_number": 1, "n_threads": 2, "n_prompt": 32,
         "n_gen": 0, "avg_ts": 100.0, "stddev_ts": 0.0, "samples_ts": [100.0],
         "samples_ns": [320000000], "flash_attn": -1, "model_filename": "m.gguf"}
    return {**e, **kw}


def test_llama_bench_json_is_split_into_pp_and_tg():
    text = json.dumps([entry(), entry(n_prompt=0, n_gen=8, avg_ts=20.0, samples_ts=[20.0])])
    out = crosscheck.parse_llama_bench(text, threads=2)
    assert out["pp"]["avg_ts"] == 100.0 and out["tg"]["avg_ts"] == 20.0
    assert out["tg"]["build_commit"] == "abc1234"


@pytest.mark.parametrize("text, match", [
    ("main: error: failed to load model", "printed no JSON"),
    (json.dumps([entry(n_threads=4)]), "ran 4 threads, asked for 2"),
    (json.dumps([entry(avg_ts=0.0)]), "no positive avg_ts"),
    (json.dumps([entry(), entry()]), "unexpected test"),
    (json.dumps([]), "no pp or tg test"),
])
def test_llama_bench_json_refused(text, match):
    with pytest.raises(EdgeInferError, match=match):
        crosscheck.parse_llama_bench(text, threads=2)


def test_verdict_agrees_only_within_five_percent():
    # overlapping ranges with medians 12% apart: not agreement
    overlap = crosscheck.compare([100.0, 130.0, 110.0], [125.0, 128.0, 127.0])
    assert overlap["ranges_overlap"] and overlap["verdict"] == "disagree"
    close = crosscheck.compare([104.0, 105.0], [100.0, 101.0])
    assert not close["ranges_overlap"] and close["verdict"] == "agree"
    assert crosscheck.compare([90.0, 91.0], [100.0, 101.0])["verdict"] == "disagree"
    far = crosscheck.compare([80.0, 81.0], [100.0, 101.0])
    assert far["verdict"] == "disagree" and far["ratio"] == pytest.approx(80.5 / 100.5, abs=1e-4)
    assert far["ours"] == {"median": 80.5, "min": 80.0, "max": 81.0}


def test_crosscheck_records_stay_out_of_the_speed_tables(tmp_path):
    path = tmp_path / "bench.jsonl"
    common = dict(engine_version="v", model="m", quant="q4_0", test="pp32", samples=[1.0])
    append_record(path, Record(engine="llama.cpp", **common))
    append_record(path, Record(engine="llama-bench", kind=crosscheck.KIND, **common))
    assert [r.engine for r in read_records(path)] == ["llama.cpp"]
    assert [r.engine for r in read_records(path, kind=crosscheck.KIND)] == ["llama-bench"]
    assert len(read_records(path, kind=None)) == 2


def test_a_tools_folder_without_llama_bench_is_built_again(tmp_path, monkeypatch):
    root = tmp_path / "tools"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-perplexity").write_text("")  # built before llama-bench was added
    monkeypatch.setattr(llama_tools, "tools_dir", lambda: root)
    built = []

    def build(dest):
        built.append(dest)
        for tool in llama_tools.TOOLS:
            (dest / "bin" / tool).write_text("")

    monkeypatch.setattr(llama_tools, "_build", build)
    assert llama_tools.tool_path("llama-bench") == root / "bin" / "llama-bench"
    assert llama_tools.tool_path("llama-perplexity").is_file()
    assert built == [root]  # once: the second call finds both
    with pytest.raises(ValueError, match="not one of"):
        llama_tools.tool_path("llama-cli")
