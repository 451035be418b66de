"""`edge-infer eval humaneval` end to end, as CI can afford it: 5 problems on smollm2-135m through
our own OpenAI server (bf16), code run in our sandbox, one record written, the page rendered.
About 90 s on 2 cores (one server start, ~45 s of it)."""

import json

import pytest

from edge_infer.api import missing_provenance

pytestmark = pytest.mark.slow


def test_humaneval_through_our_server(tmp_path, cli, smollm2):
    results = tmp_path / "tasks.jsonl"
    res = cli("eval", "humaneval", "-m", smollm2, "-b", "ours:bf16", "--limit", "5",
              "--max-tokens", "128", "--results", str(results), "--logs", str(tmp_path / "logs"),
              timeout=1200)
    print(res.stderr[-3000:])
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert rec["kind"] == "humaneval" and rec["model"] == smollm2 and rec["quant"] == "bf16"
    assert missing_provenance(rec) == [] and rec["guard"] in ("ok", "contended")
    assert rec["problems"] == 5 and [r["task_id"] for r in rec["results"]] == [
        f"HumanEval/{i}" for i in range(5)]
    # the server answered every problem with text, and the sandbox judged each one
    assert all(r["completion_tokens"] and r["status"] in ("passed", "failed", "timeout")
               for r in rec["results"])
    assert rec["passed"] == sum(r["passed"] for r in rec["results"])
    lo, hi = rec["pass_at_1_ci95"]
    assert lo <= rec["pass_at_1"] <= hi
    assert rec["server"]["server"] == "edge-infer serve" and rec["git_commit"]
    page = tmp_path / "tasks.md"
    rep = cli("eval", "report", "--results", str(results), "--out", str(page), timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert f"## {smollm2}, 5 problems" in page.read_text()
