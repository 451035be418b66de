"""Records: statistics, printers, and what a killed run leaves behind."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from edge_harness.record import Record, append_record, read_records, summarize
from edge_harness.report.printers import PRINTERS


def rec(**kw) -> Record:
    base = dict(engine="llama.cpp", engine_version="x", model="m", quant="q4_0", test="tg128",
                samples=[10.0, 12.0, 11.0])
    return Record(**{**base, **kw})


def test_stats_match_llama_bench():
    mean, sd, median = summarize([10.0, 12.0, 11.0, 15.0])
    assert mean == pytest.approx(12.0)
    assert sd == pytest.approx((2 * 2 + 0 + 1 + 9) ** 0.5 / 3 ** 0.5)  # n-1
    assert median == pytest.approx(11.5)
    assert summarize([5.0])[1] == 0.0


def test_a_torn_last_line_is_skipped_then_cut(tmp_path, caplog):
    """A crash mid-write leaves a last line without its newline: reading skips it with a
    warning, the next append cuts it first, and a bad line elsewhere is still an error."""
    path = tmp_path / "r.jsonl"
    append_record(path, rec())
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 2])  # half of a second record
    with caplog.at_level("WARNING"):
        assert [r.test for r in read_records(path)] == ["tg128"]
    assert "torn last line" in caplog.text
    append_record(path, rec(test="pp512", samples=[1.0]))
    assert [r.test for r in read_records(path)] == ["tg128", "pp512"]
    assert path.read_bytes().count(b"\n") == 2
    path.write_bytes(whole[: len(whole) // 2] + b"\n" + whole)
    with pytest.raises(ValueError, match=":1: not a harness record"):
        read_records(path)


def test_round_trip_and_printers(tmp_path):
    path = tmp_path / "r.jsonl"
    r = rec(cores=[0, 1], extra={"facts": {"threads": 2}})
    append_record(path, r)
    append_record(path, rec(test="pp512", samples=[100.0]))
    back = read_records(path)
    assert back[0].to_dict() == r.to_dict()
    assert back[0].median == 11.0 and back[1].sd == 0.0
    for name, printer in PRINTERS.items():
        text = printer(back)
        assert "tg128" in text and "pp512" in text, name
    assert len(json.loads(PRINTERS["json"](back))) == 2
    assert PRINTERS["csv"](back).count("\n") == 3
    assert PRINTERS["sql"](back).count("INSERT INTO bench") == 2


APPENDER = """
import sys
from edge_harness.record import Record, append_record
i = 0
while True:
    append_record(sys.argv[1], Record(engine="e", engine_version="v", model="m", quant="q",
                  test=f"t{i}", samples=[float(i)] * 50, extra={"pad": "x" * 3000}))
    i += 1
"""


def test_killed_writers_leave_whole_lines(tmp_path):
    """Two appenders hammer one file and are SIGKILLed mid-stream: every line parses."""
    path = tmp_path / "r.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path)]) for _ in range(2)]
    deadline = time.monotonic() + 60
    while (not path.exists() or path.stat().st_size < 200_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    records = read_records(path)
    assert len(records) > 10
    assert all(len(r.samples) == 50 for r in records)


def test_killed_bench_run_leaves_finished_records_intact(tmp_path, smollm2, edge_home):
    """A real `bench run` (llama.cpp on smollm2's GGUF), SIGKILLed after its first records."""
    results = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "edge_infer", "bench", "run", "-m", "smollm2-135m",
           "-e", "llama.cpp:original", "-p", "8,16,32,64", "-n", "2,4,8,16,32,64", "-r", "2",
           "--no-ceiling", "--force", "--window", "0.2", "--results", str(results)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if results.exists() and results.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the engine runs in a child process"
    os.kill(proc.pid, signal.SIGKILL)  # the orchestrator only: its children must follow
    proc.wait()
    records = read_records(results)  # raises on any torn line
    assert 2 <= len(records) < 10  # killed before the end (10 tests planned)
    assert results.read_bytes().endswith(b"\n")
    for r in records:
        assert r.engine == "llama.cpp" and r.model == "smollm2-135m" and len(r.samples) == 2
        assert all(s > 0 for s in r.samples)
    gone, alive = psutil.wait_procs(children, timeout=10)
    alive = [c for c in alive if _running(c)]
    assert not alive, f"pinned children outlived their parent: {alive}"


def _running(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, only not yet reaped
    except psutil.NoSuchProcess:
        return False


def test_comparison_page_is_generated_from_the_records(tmp_path):
    """docs/engines/comparison.md: ratio of medians ours / llama.cpp, % of the ceiling, the
    fidelity rows with their grid, and the section on what is not established."""
    from edge_harness.report.comparison import render

    bench = tmp_path / "bench.jsonl"
    common = dict(model="m", cores=[0, 1], threads=2, cpu_model="CPU X", isa="avx2",
                  cpu_flags=["avx2"], command="edge-infer bench run")
    append_record(bench, rec(engine="numpy", quant="-", test="ceiling", samples=[20.0],
                             unit="GB/s", **common))
    append_record(bench, rec(engine="ours", quant="w4a16", samples=[30.0, 32.0, 31.0],
                             achieved_gbs=3.1, bits_per_weight=4.5, **common))
    append_record(bench, rec(engine="llama.cpp", quant="q4_k_m", samples=[60.0, 62.0, 61.0],
                             achieved_gbs=6.1, bits_per_weight=5.2, **common))
    fid = {"kind": "fidelity", "model": "m", "engine": "ours", "quant": "w4a16", "base": "ours:bf16",
           "source_grid": "Q4_1 (groups of 32)", "bits_per_weight": 4.5, "greedy_exact": 3,
           "greedy_prompts": 12, "same_top_pct": 91.5, "kl_mean": 0.0421, "kl_p99": 0.5,
           "ppl_ratio": 1.03, "n_ctx": 512, "machine": {"cpu_model": "CPU X", "isa": "avx2"},
           "command": "edge-infer fidelity run"}
    (tmp_path / "fidelity.jsonl").write_text(json.dumps(fid) + "\n")
    md = render(tmp_path)
    assert "**0.51x**" in md  # 31 / 61
    assert "15.5" in md  # 3.1 GB/s of the 20 GB/s ceiling, in %
    assert "| m | Q4_1 | ours | w4a16 | ours:bf16 | 4.50 | 3/12 | 91.50 | 0.04210 |" in md
    assert "## What the comparisons do not establish" in md
    assert "no export.jsonl" in md


def test_ratios_never_span_two_runs():
    """A later run that re-measures only llama.cpp must not be divided into an older run of
    ours: each ratio pairs records of one run (interleaved, same machine state)."""
    from edge_harness.report.render import latest, ratio_rows

    def rec(run, engine, quant, tok_s):
        return Record(engine=engine, engine_version="v", model="m", quant=quant, test="tg128",
                      samples=[tok_s], threads=2, run_id=run)

    old = [rec("r1", "ours", "w4a16", 10.0), rec("r1", "llama.cpp", "q4_k_m", 40.0)]
    new = [rec("r2", "llama.cpp", "q4_k_m", 50.0), rec("r2", "ours", "w4a16-head", 20.0)]
    everything = old + new
    rows = {r[2]: r for r in ratio_rows(latest(everything), everything)}
    assert rows["ours w4a16 / llama.cpp q4_k_m"][3:6] == ["10.00", "40.00", "**0.25x**"]
    assert rows["ours w4a16-head / llama.cpp q4_k_m"][3:6] == ["20.00", "50.00", "**0.40x**"]
    # without the pool, the old ours record has no partner in the newest records: no row
    assert "ours w4a16 / llama.cpp q4_k_m" not in {r[2] for r in ratio_rows(latest(everything))}
