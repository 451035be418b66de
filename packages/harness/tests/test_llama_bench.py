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
    out = llama_tools.parse_llama_bench(text, threads=2)
    assert out["pp"]["avg_ts"] == 100.0 and out["tg"]["avg_ts"] == 20.0
    assert out["tg"]["build_commit"] == "abc1234"


def test_llama_bench_records_keep_the_model_file_name_only():
    # llama-bench echoes the path it was given: a record must not carry this machine's paths
    text = json.dumps([entry(model_filename="/home/someone/.cache/gguf/m-q4_k_m.gguf")])
    assert llama_tools.parse_llama_bench(text, threads=2)["pp"]["model_filename"] == "m-q4_k_m.gguf"


@pytest.mark.parametrize("text, match", [
    ("main: error: failed to load model", "printed no JSON"),
    (json.dumps([entry(n_threads=4)]), "ran 4 threads, asked for 2"),
    (json.dumps([entry(avg_ts=0.0)]), "no positive avg_ts"),
    (json.dumps([entry(), entry()]), "unexpected test"),
    (json.dumps([]), "no pp or tg test"),
])
def test_llama_bench_json_refused(text, match):
    with pytest.raises(EdgeInferError, match=match):
        llama_tools.parse_llama_bench(text, threads=2)


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


def fake_tool(tmp_path, body: str):
    tool = tmp_path / "bin" / "llama-bench"
    tool.parent.mkdir(parents=True, exist_ok=True)
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return tool


def test_tool_version_reads_the_build_commit(tmp_path):
    tool = fake_tool(tmp_path, 'echo "version: 0.5.0-dev (build 7, commit 0c1e570)" >&2\n'
                               'echo "built with GNU 12.2.0 for Linux x86_64" >&2\n')
    v = llama_tools.tool_version(tool)
    assert v == {"version": "0.5.0-dev", "build_number": "7", "build_commit": "0c1e570",
                 "compiler": "GNU 12.2.0 for Linux x86_64"}
    with pytest.raises(EdgeInferError, match="no build commit"):
        llama_tools.tool_version(fake_tool(tmp_path, "echo oops\n"))


def test_llama_bench_runner_times_one_invocation_per_repetition(tmp_path, monkeypatch):
    """The runner passes -p/-n/-t/-r 1 and returns llama-bench's own sample, not its wall time
    (which includes the model load and the warm-up)."""
    from edge_harness.runners import get_runner, llama_bench
    from edge_harness.runners.base import Build

    args = tmp_path / "args"
    pp, tg = entry(n_prompt=64, samples_ns=[250_000_000]), entry(n_prompt=0, n_gen=16,
                                                                 samples_ns=[400_000_000])
    tool = fake_tool(tmp_path, f"""case "$1" in --version)
  echo "version: 1 (build 2, commit abc1234)"; echo "built with cc"; exit 0;; esac
echo "$@" >> {args}
case "$*" in *"-p 64 -n 0"*) echo '{json.dumps([pp])}';; *) echo '{json.dumps([tg])}';; esac
""")
    monkeypatch.setattr(llama_bench, "tool_path", lambda name: tool)
    runner = get_runner("llama-bench")()
    facts = runner.load(Build("llama-bench", "m", "q4_k_m", "m.gguf", 4.5, 1, 100), 2, 128)
    assert facts["build_commit"] == "abc1234" and facts["threads"] == 2
    assert runner.pp(64, seed=0) == pytest.approx(0.25)
    assert runner.last_extra["n_prompt"] == 64
    assert runner.tg(16, seed=0) == pytest.approx(0.4)
    assert args.read_text().splitlines() == [
        "-m m.gguf -p 64 -n 0 -r 1 -t 2 -o json", "-m m.gguf -p 0 -n 16 -r 1 -t 2 -o json"]
    with pytest.raises(RuntimeError, match="no pp32 result"):
        runner.pp(32, seed=0)
