"""The real llama-bench beside our llama.cpp runner (`edge-infer bench crosscheck`) on the
smallest model, tiny sizes. Structure only: speed is a benchmark, so the ratio and the verdict
are recorded and printed, never asserted; --force, since a noisy CI machine must not fail it
(the record then says guard: overridden)."""

import json

from edge_infer.api import missing_provenance


def test_llama_bench_runs_beside_our_runner(tmp_path, cli, smollm2):
    results = tmp_path / "bench.jsonl"
    res = cli("bench", "crosscheck", "-m", smollm2, "-q", "q4_0", "-p", "32", "-n", "8", "-r", "2",
              "-t", "1", "--force", "--lock-wait", "600", "--results", str(results),
              timeout=3600)
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["test"] for r in records] == ["pp32", "tg8"]
    for r in records:
        x = r["extra"]
        assert r["kind"] == "llama_bench_crosscheck" and r["engine"] == "llama-bench"
        assert missing_provenance(r) == []
        # llama-bench's JSON, one invocation per round, same sizes and threads as our runner
        assert len(x["llama_bench_json"]) == 2 and len(x["ours_samples"]) == 2
        for e in x["llama_bench_json"]:
            assert (e["n_prompt"], e["n_gen"]) == (r["n_prompt"], r["n_gen"])
            assert e["n_threads"] == r["threads"] == x["ours_facts"]["threads"] == 1
            assert e["build_commit"] == x["build_commit"]
        assert x["build_commit"] and x["build_commit"] in r["engine_version"]
        assert r["samples"] == [e["avg_ts"] for e in x["llama_bench_json"]]
        assert all(s > 0 for s in r["samples"] + x["ours_samples"])
        assert x["llama_bench"]["median"] > 0 and x["ours"]["median"] > 0
        assert x["ratio"] > 0 and x["verdict"] in ("agree", "disagree")
        # provenance and what the guard saw
        assert r["git_commit"] and r["git_dirty"] is not None and r["command"]
        assert r["cpu_model"] and r["run_id"] and x["versions"]
        assert r["guard"] in ("ok", "overridden") and r["guard_threshold"] is not None
        assert r["guard_mean_load"] is not None and r["guard_peak_load"] is not None
    assert "ours/llama-bench" in res.stdout
