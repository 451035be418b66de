"""Records: statistics, printers, and what a killed run leaves behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    assert "no executorch records" in md


def test_comparison_export_table_keeps_exports_and_leaves_ablation_rows_out(tmp_path):
    """An eager ablation variant (8da8w scored under target xnnpack-8da4w) must never stand in
    for the target's export row."""
    from edge_harness.report.comparison import export_section

    base = {"model": "m", "target": "xnnpack-8da4w", "calibration": None,
            "sink_prefix": {"token_id": 1}}
    rows = [dict(base, sqnr_db=23.8, measured="pte"),
            dict(base, sqnr_db=26.0, measured="eager", variant="8da8w")]
    (tmp_path / "export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = export_section(tmp_path)
    assert "| m | xnnpack-8da4w | none | yes | 23.8 | pte |" in md
    assert "26.0" not in md and "eager" not in md.split("Details")[1]


def test_comparison_shows_executorch_beside_the_engines_of_its_own_run(tmp_path):
    from edge_harness.report.comparison import render

    bench = tmp_path / "bench.jsonl"
    common = dict(model="m", cores=[0, 1], threads=2, cpu_model="CPU X", isa="avx2",
                  cpu_flags=["avx2"], command="edge-infer bench run", test="tg128")
    append_record(bench, rec(engine="llama-bench", quant="q4_k_m", samples=[40.0, 41.0, 42.0],
                             run_id="old", **common))  # another run: never beside it
    facts = {"facts": {"static_context": 512, "prefill_chunk": 128}}
    append_record(bench, rec(engine="executorch", quant="8da4w", samples=[10.0, 11.0, 12.0],
                             run_id="r1", bits_per_weight=5.1, git_commit="abcdef123",
                             extra=facts, **common))
    append_record(bench, rec(engine="llama-bench", quant="q4_k_m", samples=[20.0, 22.0, 24.0],
                             run_id="r1", **common))
    md = render(tmp_path)
    assert "## The phone engine on this CPU: ExecuTorch (XNNPACK)" in md
    assert ("| m | 8da4w | tg128 | 5.10 | 11.00 (10.00-12.00) | llama-bench q4_k_m 22.00 "
            "(0.50x, slower) |") in md
    assert "static cache of 512 slots" in md and "commits abcdef1." in md


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
    rows = {r[3]: r for r in ratio_rows(latest(everything), everything)}
    assert rows["ours w4a16 / llama.cpp q4_k_m"][4:7] == ["10.00", "40.00", "**0.25x** slower"]
    assert rows["ours w4a16-head / llama.cpp q4_k_m"][4:7] == ["20.00", "50.00", "**0.40x** slower"]
    # without the pool, the old ours record has no partner in the newest records: no row
    assert "ours w4a16 / llama.cpp q4_k_m" not in {r[3] for r in ratio_rows(latest(everything))}



def test_each_machine_keeps_its_own_newest_ratio():
    """A newer run on another CPU must not replace a CPU's ratio: the table keeps the newest
    pair of each machine and names it (an AVX2 ratio is not an AVX-512 one)."""
    from edge_harness.report.render import latest_per_machine, ratio_rows

    def rec(run, cpu, flags, engine, tok_s, ts):
        return Record(engine=engine, engine_version="v", model="m", quant="w4a8-head" if
                      engine == "ours" else "q4_k_m", test="pp512", samples=[tok_s], threads=2,
                      run_id=run, cpu_model="EPYC", cpu_id=cpu, isa=flags[-1], cpu_flags=flags,
                      timestamp=ts)

    zen4 = [rec("r1", "25/17/1", ["avx2", "avx512"], "ours", 160.0, "2026-12-03T00:00:00Z"),
            rec("r1", "25/17/1", ["avx2", "avx512"], "llama-bench", 80.0, "2026-12-03T00:00:01Z")]
    zen3 = [rec("r2", "25/1/1", ["avx2"], "ours", 60.0, "2026-12-07T00:00:00Z"),
            rec("r2", "25/1/1", ["avx2"], "llama-bench", 40.0, "2026-12-07T00:00:01Z")]
    everything = zen4 + zen3
    rows = ratio_rows(latest_per_machine(everything), everything)
    assert sorted((r[1], r[6]) for r in rows) == [
        ("EPYC (avx2, 25/1/1)", "**1.50x** faster"), ("EPYC (avx512, 25/17/1)", "**2.00x** faster")]
    # a newer run on the same machine does replace its own pair
    zen3b = [rec("r3", "25/1/1", ["avx2"], "ours", 50.0, "2026-12-08T00:00:00Z"),
             rec("r3", "25/1/1", ["avx2"], "llama-bench", 50.0, "2026-12-08T00:00:01Z")]
    rows = ratio_rows(latest_per_machine(everything + zen3b), everything + zen3b)
    assert sorted((r[1], r[6]) for r in rows) == [
        ("EPYC (avx2, 25/1/1)", "**1.00x** within noise"),
        ("EPYC (avx512, 25/17/1)", "**2.00x** faster")]


def test_a_run_with_llama_bench_pairs_ours_with_llama_bench_not_our_runner():
    from edge_harness.report.render import latest, ratio_rows

    def rec(engine, quant, tok_s):
        return Record(engine=engine, engine_version="v", model="m", quant=quant, test="tg128",
                      samples=[tok_s], threads=2, run_id="r1")

    run = [rec("ours", "w4a16", 30.0), rec("llama.cpp", "q4_k_m", 40.0),
           rec("llama-bench", "q4_k_m", 60.0)]
    rows = {r[3]: r for r in ratio_rows(latest(run), run)}
    assert list(rows) == ["ours w4a16 / llama-bench q4_k_m"]
    assert rows["ours w4a16 / llama-bench q4_k_m"][4:7] == ["30.00", "60.00", "**0.50x** slower"]

def test_a_build_variant_is_its_own_measurement_and_never_pairs_as_the_build():
    """`ours:w4a8-head@act_dtype=bfloat16` in the same run as `ours:w4a8-head`: the newest-record
    pick keeps both, labels the variant with its options, and the ratio of w4a8-head is the
    plain build's, whichever of the two was written last."""
    from edge_harness.report.render import latest, ratio_rows

    def rec(engine, quant, tok_s, **options):
        return Record(engine=engine, engine_version="v", model="m", quant=quant, test="tg128",
                      samples=[tok_s], threads=2, run_id="r1", extra={"options": options})

    run = [rec("llama-bench", "q4_k_m", 40.0), rec("ours", "w4a8-head", 20.0),
           rec("ours", "w4a8-head", 30.0, act_dtype="bfloat16")]
    shown = latest(run)
    assert sorted(r.build for r in shown if r.engine == "ours") == [
        "w4a8-head", "w4a8-head@act_dtype=bfloat16"]
    rows = {r[3]: r for r in ratio_rows(shown, run)}
    assert rows["ours w4a8-head / llama-bench q4_k_m"][4:7] == ["20.00", "40.00", "**0.50x** slower"]
    # llama-bench's JSON names the variant too, so two rows of one run never read as one build
    from edge_harness.report.printers import llama_bench_fields

    assert sorted(llama_bench_fields(r)["model_type"] for r in shown if r.engine == "ours") == [
        "m w4a8-head", "m w4a8-head@act_dtype=bfloat16"]


# -- llama-bench's output schema ----------------------------------------------------------------
# The JSON example of llama.cpp's tools/llama-bench/README.md (build 5163, pp512 and tg128).
LLAMA_BENCH_JSON = Path(__file__).parent / "data" / "llama_bench_b5163.json"
QUOTED = {"model_type", "n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts", "avg_ns",
          "stddev_ns", "samples_ts", "samples_ns", "build_commit", "cpu_info"}


def bench_records() -> list[Record]:
    kw = dict(engine="llama.cpp", engine_version="b5163", model="qwen3-0.6b", quant="q4_k_m",
              threads=2, cores=[0, 1], cpu_model="AMD EPYC", git_commit="0123456789abcdef",
              timestamp="2025-04-24T11:58:50Z")
    return [Record(test="pp512", n_prompt=512, samples=[118.0, 120.0, 119.5], **kw),
            Record(test="tg128", n_gen=128, samples=[31.5, 31.7, 31.2], **kw)]


def _type(v):
    return list if isinstance(v, list) else type(v)


def test_json_has_llama_bench_keys_first_with_its_types_and_meanings():
    theirs = json.loads(LLAMA_BENCH_JSON.read_text())
    ours = json.loads(PRINTERS["json"](bench_records()))
    shared = [k for k in theirs[0] if k in ours[0]]
    assert QUOTED <= set(shared), sorted(QUOTED - set(shared))
    assert list(ours[0])[: len(shared)] == shared  # first, and in llama-bench's order
    for t, o in zip(theirs, ours, strict=True):
        for k in shared:
            assert _type(o[k]) is _type(t[k]), (k, o[k], t[k])
            if isinstance(t[k], list):
                assert {type(x) for x in o[k]} == {type(x) for x in t[k]}, k
    # the same meanings: one repetition's tokens/s is its tokens over its seconds, and the
    # averages are the means of the samples (checked on llama-bench's own output too)
    for rec in (*theirs, *ours):
        tokens = rec["n_prompt"] + rec["n_gen"]
        for ns, ts in zip(rec["samples_ns"], rec["samples_ts"], strict=True):
            assert ts == pytest.approx(1e9 * tokens / ns, rel=1e-4)
        assert rec["avg_ts"] == pytest.approx(sum(rec["samples_ts"]) / len(rec["samples_ts"]),
                                              rel=1e-4)
        assert rec["avg_ns"] == pytest.approx(sum(rec["samples_ns"]) / len(rec["samples_ns"]),
                                              rel=1e-6)
    assert ours[0]["cpu_mask"] == "0x3" and ours[0]["build_commit"] == "01234567"
    assert ours[1]["model_type"] == "qwen3-0.6b q4_k_m" and ours[1]["n_threads"] == 2
    # our own fields follow, so the output still reads back as our records
    assert Record.from_dict(ours[1]).to_dict() == bench_records()[1].to_dict()


def test_csv_sql_jsonl_and_md_open_with_llama_bench_columns():
    theirs = list(json.loads(LLAMA_BENCH_JSON.read_text())[0])
    recs = bench_records()
    header = PRINTERS["csv"](recs).splitlines()[0].split(",")
    shared = [k for k in theirs if k in header]
    assert header[: len(shared)] == shared and QUOTED - {"samples_ts", "samples_ns"} <= set(shared)
    sql = PRINTERS["sql"](recs)
    assert "avg_ts REAL" in sql and "avg_ns INTEGER" in sql and "n_prompt INTEGER" in sql
    line = json.loads(PRINTERS["jsonl"](recs).splitlines()[0])
    assert list(line)[: len(shared) + 2] == [k for k in theirs if k in line]
    md = PRINTERS["md"](recs).splitlines()[0]
    assert md.startswith("| model | threads | test | t/s |")


def test_records_that_are_not_tokens_per_second_leave_llama_bench_timings_empty():
    ceiling = Record(engine="numpy", engine_version="numpy", model="-", quant="-", test="ceiling",
                     samples=[20.0, 21.0], unit="GB/s", threads=2, cores=[0, 1])
    (row,) = json.loads(PRINTERS["json"]([ceiling]))
    assert all(row[k] is None for k in ("avg_ts", "stddev_ts", "avg_ns", "stddev_ns",
                                        "samples_ts", "samples_ns"))
    assert row["n_threads"] == 2 and row["samples"] == [20.0, 21.0]
    sql = PRINTERS["sql"]([ceiling, *bench_records()])
    assert "avg_ts REAL" in sql  # typed from the first row that has a value


def test_a_ratio_is_faster_or_slower_only_when_the_ranges_do_not_overlap():
    from edge_harness.report.render import noise_verdict

    assert noise_verdict([10.0, 11.0, 12.0], [8.0, 9.0, 9.5]) == "faster"
    assert noise_verdict([8.0, 9.0], [10.0, 12.0]) == "slower"
    # a 1.2x ratio of medians whose ranges overlap is not a claim
    assert noise_verdict([11.0, 12.0, 15.0], [9.0, 10.0, 11.5]) == "within noise"


def test_a_ceiling_is_filled_in_only_from_one_measured_before_and_never_into_a_gemm():
    """A --no-ceiling decode record gets the ceiling its run reused (the newest one before it on
    the same cores); a GEMM record keeps what its own run gave it, even when that is none."""
    from edge_harness.report.render import fill_ceiling

    def ceiling(ts, gbs):
        return rec(engine="numpy", model="-", quant="-", test="ceiling", unit="GB/s",
                   samples=[gbs - 1, gbs], cores=[0, 1], timestamp=ts)

    def decode(ts, cores=(0, 1)):
        return rec(test="tg128", cores=list(cores), timestamp=ts, achieved_gbs=10.0)

    gemm = rec(engine="edge-avx512", quant="w4a8", test="gemm_m1_qkv_proj", unit="GFLOP/s",
               cores=[0, 1], timestamp="2026-01-03T00:00:00Z", achieved_gbs=10.0,
               extra={"m": 1, "layer": "qkv_proj"})
    early, late = decode("2026-01-02T00:00:00Z"), decode("2026-01-01T00:00:00Z")
    other = decode("2026-01-02T00:00:00Z", cores=(2, 3))
    records = [ceiling("2026-01-01T12:00:00Z", 20.0), ceiling("2026-01-04T00:00:00Z", 40.0),
               early, late, other, gemm]
    fill_ceiling(records)
    assert early.pct_ceiling == pytest.approx(50.0)  # the 20 GB/s measured before it
    assert early.extra["ceiling_from_report"]
    assert late.pct_ceiling is None and other.pct_ceiling is None  # none before it / its cores
    assert gemm.pct_ceiling is None


def test_batched_decode_shows_each_machine_and_a_newer_run_replaces_only_its_own(tmp_path):
    """`bench report`'s batched-decode table keeps the newest run of each CPU: an AVX2 run
    after an AVX-512 one of the same test leaves the AVX-512 rows in place, each row names its
    machine, and x B=1 is taken within one run."""
    from edge_harness.record import append_record
    from edge_harness.report.render import render

    def step(run, isa, cpu_id, batch, ms):
        return rec(engine="ours", quant="w4a8-head", model="qwen3-0.6b-random",
                   test=f"batched_b{batch}_tg32", unit="ms/step", samples=[ms, ms * 1.1, ms * 0.9],
                   n_gen=32, extra={"batch": batch}, run_id=run, isa=isa, cpu_id=cpu_id,
                   cpu_model="AMD EPYC", timestamp=f"2026-12-0{run[-1]}T00:00:00Z")

    path = tmp_path / "bench.jsonl"
    for r in (step("run1", "avx512", "AuthenticAMD 25/17/1", 1, 20.0),
              step("run1", "avx512", "AuthenticAMD 25/17/1", 8, 36.0),
              step("run2", "avx2", "AuthenticAMD 25/1/1", 1, 30.0),
              step("run2", "avx2", "AuthenticAMD 25/1/1", 8, 90.0),
              step("run3", "avx2", "AuthenticAMD 25/1/1", 8, 80.0)):
        append_record(path, r)
    render(path, tmp_path / "out")
    page = (tmp_path / "out" / "report.md").read_text()
    table = page[page.index("## Batched decode"):]
    rows = [line for line in table.splitlines() if line.startswith("| AMD EPYC")]
    assert len(rows) == 4, rows  # both avx512 rows, avx2's B=1 and its newest B=8 (run3)
    assert sum("(avx512, AuthenticAMD 25/17/1)" in line for line in rows) == 2
    assert any("run3" in line for line in rows) and not any("| run2 |" in line and "| 8 |" in line
                                                            for line in rows)
    avx512_b8 = next(line for line in rows if "avx512" in line and "| 8 |" in line)
    assert "| 1.80x |" in avx512_b8  # 36 / 20, within run1
