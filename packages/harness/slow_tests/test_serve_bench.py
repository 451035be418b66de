"""`edge-infer bench serve` on the smallest model, a short window: both servers (ours and
llama-server, built from the sdist with the other llama.cpp tools) answer every request of
vLLM's serving client, and each record is written with its provenance. Structure only: the
figures are printed, never asserted (a benchmark, not a test). It runs with --force, like the
other structure tests: a CI machine is shared, and a blip of foreign load must not fail a check
that asserts no speed (the record then says guard: overridden)."""

import json

from edge_infer.api import missing_provenance


def test_both_servers_answer_every_request_and_the_records_are_written(tmp_path, cli, smollm2):
    results = tmp_path / "serve.jsonl"
    res = cli("bench", "serve", "-m", smollm2, "-e", "ours:w4a16,llama.cpp:q4_0", "-c", "2",
              "--input-len", "16:64", "--output-len", "8:32", "--rounds", "3", "--seed", "1",
              "--force", "--lock-wait", "600", "--results", str(results), timeout=3600)
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["engine"], r["test"]) for r in records] == [("ours", "serve_c2"),
                                                           ("llama.cpp", "serve_c2")]
    for r in records:
        x = r["extra"]
        # every request answered, each with the output length it asked for (EOS ignored)
        assert x["concurrency"] == 2 and x["num_prompts"] == x["requests"] == 6
        assert x["completed"] == 6 and x["failed"] == 0 and x["errors"] == {}
        assert 8 <= x["output_len"]["min"] <= x["output_len"]["max"] <= 32
        assert x["short_requests"] == 0  # each answer as long as asked, by the server's count
        assert x["total_output_tokens"] == x["asked_output_tokens"] >= 6 * 8
        assert r["samples"] == [x["output_tok_s"]] and x["output_tok_s"] > 0
        assert x["requests_s"] > 0 and x["ttft_ms"]["p99"] >= x["ttft_ms"]["p50"] > 0
        assert x["tpot_ms"]["p50"] > 0 and x["warmups"] == 2
        # both servers got the same workload, one slot per concurrent request
        assert x["workload"] == records[0]["extra"]["workload"] and x["workload"]["seed"] == 1
        assert x["server"]["slots"] == 2 and x["server"]["ctx_per_slot"] >= 64 + 32
        assert x["client"]["tool"].startswith("vllm bench serve")
        assert not any("/" in a for a in x["server"]["argv"] + x["client"]["argv"]
                       if not a.startswith(("http", "{", "/v1")))  # no paths of this machine
        # provenance and what the guard saw
        assert r["kind"] == "serve" and r["threads"] == len(r["cores"]) > 0
        assert r["git_commit"] and r["git_dirty"] is not None and r["command"]
        assert r["cpu_model"] and r["cpu_flags"] and r["run_id"] and x["versions"]
        assert r["guard"] in ("ok", "overridden") and r["guard_threshold"] is not None
        assert missing_provenance(r) == []
        assert r["guard_mean_load"] is not None and r["guard_peak_load"] is not None
    ours, theirs = records
    assert ours["engine_version"].startswith("edge-infer ") and "vllm" in ours["engine_version"]
    assert theirs["extra"]["server"]["build_commit"] in theirs["engine_version"]
    assert "| 2 | ours | w4a16 |" in res.stdout and "w4a16 / q4_0" in res.stdout
