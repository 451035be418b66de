"""`bench serve`'s pure parts: the workload it asks vLLM's client for, the plan checks, the
figures it keeps of a client result, and the page made of its records. The run against both
servers is slow_tests/test_serve_bench.py."""

import math

import pytest

from edge_harness.bench import serve, serve_client
from edge_harness.bench.run import parse_engine
from edge_harness.record import Record, append_record
from edge_harness.report import serve as page
from edge_infer.api import UsageError


@pytest.mark.parametrize(("lo", "hi"), [(128, 1024), (64, 256), (16, 64), (8, 32), (7, 9),
                                        (5, 5), (1, 1001)])
def test_length_args_give_exactly_the_stated_range(lo, hi):
    mean, ratio = serve.length_args(lo, hi)
    assert 0 <= ratio < 1  # vLLM refuses 1 and above
    # vLLM's random dataset: uniform integers in [floor(M(1-R)), ceil(M(1+R))]
    assert (math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))) == (lo, hi)


def _plan(**kw):
    base = {"model": "smollm2-135m",
            "engines": [parse_engine("ours:w4a16"), parse_engine("llama.cpp:q4_0")]}
    return serve.ServePlan(**{**base, **kw})


@pytest.mark.parametrize(("kw", "says"), [
    ({"concurrency": [0]}, "concurrencies"),
    ({"concurrency": []}, "concurrencies"),
    ({"input_len": (64, 16)}, "--input-len"),
    ({"output_len": (0, 8)}, "--output-len"),
    ({"output_len": (8, 31)}, "must be even"),
    ({"rounds": 0}, "--rounds"),
    ({"engines": [parse_engine("torch:fp32")]}, "runs ours and llama.cpp"),
    ({"engines": [parse_engine("ours:w4a16"), parse_engine("ours:bf16")]}, "twice"),
    ({"engines": [parse_engine("llama.cpp:q4_0@threads=1")]}, "@threads"),
    ({"engines": [parse_engine("ours:w4a16@prefix_caching=on")]}, "@prefix_caching"),
])
def test_a_plan_that_cannot_run_is_refused_before_anything_starts(kw, says):
    with pytest.raises(UsageError, match=says):
        serve.check(_plan(**kw))


def test_the_client_gets_the_workload_and_the_record_no_port_or_path(tmp_path):
    plan = _plan(input_len=(16, 64), output_len=(8, 32), rounds=3, seed=7)
    serve.check(plan)
    argv = serve.client_argv(plan, "http://127.0.0.1:4321", "smollm2-135m", tmp_path / "hf", 4,
                             cache_prompt=False)
    opt = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert opt["--num-prompts"] == "12" and opt["--max-concurrency"] == "4"
    assert opt["--num-warmups"] == "4" and opt["--seed"] == "7"
    assert opt["--dataset-name"] == "random" and opt["--temperature"] == "0"
    assert opt["--extra-body"] == '{"cache_prompt": false}'
    assert "--ignore-eos" in argv
    shown = serve.shown_argv(argv, "smollm2-135m")
    assert "4321" not in " ".join(shown) and str(tmp_path) not in " ".join(shown)
    assert plan.ctx_per_slot >= 64 + 32
    assert serve.client_argv(plan, "b", "m", tmp_path, 1, None).count("--extra-body") == 0


def test_summarize_keeps_the_figures_and_counts_each_error():
    result = {"output_throughput": 40.0, "request_throughput": 0.5, "duration": 8.0,
              "completed": 3, "failed": 1, "total_input_tokens": 90, "total_output_tokens": 60,
              "p50_ttft_ms": 100.0, "p99_ttft_ms": 300.0, "mean_ttft_ms": 150.0,
              "p50_tpot_ms": 20.0, "p99_tpot_ms": 25.0,
              "errors": ["", "", "Traceback ...\nConnectionError: refused", ""],
              "input_lens": [20, 30, 40, 0], "output_lens": [10, 20, 30, 0]}
    s = serve_client.summarize(result)
    assert (s["output_tok_s"], s["requests_s"], s["completed"], s["failed"]) == (40.0, 0.5, 3, 1)
    assert s["ttft_ms"] == {"mean": 150.0, "p50": 100.0, "p99": 300.0}
    assert s["tpot_ms"] == {"p50": 20.0, "p99": 25.0}
    assert s["errors"] == {"ConnectionError: refused": 1} and s["requests"] == 4
    assert s["input_len"] == {"min": 20, "max": 40} and s["output_len"] == {"min": 10, "max": 30}


def _record(engine, quant, c, tok_s, ttft_p99, **kw):
    return Record(engine=engine, engine_version=f"{engine} 1", model="smollm2-135m", quant=quant,
                  test=f"serve_c{c}", samples=[tok_s], threads=2, cores=[0, 1], kind="serve",
                  cpu_model="cpu", isa="avx2", git_commit="abc", git_dirty=False,
                  command="edge-infer bench serve", **kw,
                  extra={"concurrency": c, "requests_s": tok_s / 50, "failed": 0,
                         "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99},
                         "tpot_ms": {"p50": 30.0, "p99": 40.0},
                         "workload": {"shared_prefix": 0, "input_len": [16, 64],
                                      "output_len": [8, 32]},
                         "client": {"tool": "vllm bench serve (vllm 0.32.0)"}})


def test_the_page_shows_every_build_and_the_ratio_at_each_concurrency(tmp_path):
    results = tmp_path / "serve.jsonl"
    for rec in [_record("ours", "w4a16", 8, 90.0, 999.0),  # replaced by the newer one below
                _record("ours", "w4a16", 1, 20.0, 400.0), _record("llama.cpp", "q4_0", 1, 40.0, 200.0),
                _record("ours", "w4a16", 8, 100.0, 900.0), _record("llama.cpp", "q4_0", 8, 50.0, 1800.0)]:
        append_record(results, rec)
    # a bench record in the same file is not a serving figure
    append_record(results, Record(engine="ours", engine_version="x", model="m", quant="q",
                                  test="tg128", samples=[1.0]))
    text = page.render(results, tmp_path).read_text()
    assert (tmp_path / "serve.png").stat().st_size > 0
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 8 ")]
    assert len(rows) == 4  # newest of each (build, concurrency); the bench record left out
    assert "| 8 | ours | w4a16 | 100.00 |" in text and "90.00" not in text
    assert "| smollm2-135m | 1 | w4a16 / q4_0 | 0.50 | 2.00 |" in text
    assert "| smollm2-135m | 8 | w4a16 / q4_0 | 2.00 | 0.50 |" in text
    assert "Warning" not in text


def test_a_table_and_its_ratios_come_from_the_newest_run_only(tmp_path):
    """A newer run of another build replaces the older run's rows: its llama.cpp row is never
    divided into the older run's build, nor shown beside it."""
    results = tmp_path / "serve.jsonl"
    for run, quant, ours, theirs in [("20261203T100000-1", "w4a16", 60.0, 50.0),
                                     ("20261204T100000-1", "w4a8", 120.0, 55.0)]:
        for rec in [_record("ours", quant, 8, ours, 900.0, run_id=run),
                    _record("llama.cpp", "q4_0", 8, theirs, 1800.0, run_id=run)]:
            append_record(results, rec)
    text = page.render(results, tmp_path).read_text()
    assert "| 8 | ours | w4a8 | 120.00 |" in text and "| 8 | llama.cpp | q4_0 | 55.00 |" in text
    assert "w4a16" not in text and "50.00" not in text
    assert "| smollm2-135m | 8 | w4a8 / q4_0 | 2.18 | 0.50 |" in text
    from edge_harness.report.comparison import serve_section
    section = serve_section(tmp_path)
    assert "w4a8 / q4_0 | 2.18" in section and "w4a16" not in section


def test_each_table_names_its_own_run_and_machine(tmp_path):
    """One table per model, workload and machine: a newer run on another CPU adds its own table
    and never replaces this one's; each section says which run, commit and CPU it shows, and
    comparison.md's serving rows name their CPU and workload."""
    results = tmp_path / "serve.jsonl"
    runs = [("m-a", "20261203T100000-1", "Xeon", "avx512", "GenuineIntel 6/207/2"),
            ("m-b", "20261207T100000-1", "EPYC", "avx2", "AuthenticAMD 25/1/1")]
    for model, run, cpu, isa, cpu_id in runs:
        for rec in [_record("ours", "w4a8", 8, 100.0, 900.0, run_id=run),
                    _record("llama.cpp", "q4_0", 8, 50.0, 1800.0, run_id=run)]:
            rec.model, rec.cpu_model, rec.isa, rec.cpu_id = model, cpu, isa, cpu_id
            append_record(results, rec)
    # a newer run of m-a on the other machine adds its table; the Xeon's stays
    for rec in [_record("ours", "w4a8", 8, 60.0, 900.0, run_id="20261208T100000-1"),
                _record("llama.cpp", "q4_0", 8, 50.0, 1800.0, run_id="20261208T100000-1")]:
        rec.model, rec.cpu_model, rec.isa, rec.cpu_id = "m-a", "EPYC", "avx2", "AuthenticAMD 25/1/1"
        append_record(results, rec)
    # m-b's shared-prefix workload: its own table and its own rows, named as such
    for rec in [_record("ours", "w4a8", 8, 90.0, 900.0, run_id="20261207T110000-1"),
                _record("llama.cpp", "q4_0", 8, 30.0, 1800.0, run_id="20261207T110000-1")]:
        rec.model, rec.test = "m-b", "serve_c8_prefix256"
        rec.extra["workload"]["shared_prefix"] = 256
        append_record(results, rec)
    text = page.render(results, tmp_path).read_text()
    a, b = text.split("## m-b", 1)
    assert "Run `20261203T100000-1`, git abc, on Xeon (avx512, GenuineIntel 6/207/2)" in a
    assert "Run `20261207T100000-1`, git abc, on EPYC (avx2, AuthenticAMD 25/1/1)" in b
    from edge_harness.report.comparison import serve_section
    section = serve_section(tmp_path)
    assert "| m-a | random | Xeon (avx512, GenuineIntel 6/207/2) | 8 | w4a8 / q4_0 | 2.00 |" in section
    assert "| m-b | random | EPYC (avx2, AuthenticAMD 25/1/1) | 8 | w4a8 / q4_0 | 2.00 |" in section
    assert "| m-b | shared prefix 256 | cpu (avx2) | 8 | w4a8 / q4_0 | 3.00 |" in section
    assert "| m-a | random | EPYC (avx2, AuthenticAMD 25/1/1) | 8 | w4a8 / q4_0 | 1.20 |" in section
    assert "Run `20261208T100000-1`, git abc, on EPYC (avx2, AuthenticAMD 25/1/1)" in a


def test_a_window_that_lost_requests_keeps_the_server_log_and_its_errors(edge_home, tmp_path):
    log = tmp_path / "llama.cpp.log"
    log.write_text("0.00.1 I srv load_model: n_ctx_slot = 1344\n"
                   "1.40.2 E slot launch_slot_: the request exceeds the available context size\n"
                   "INFO 12-04 vLLM engine ready\n"
                   "ERROR 12-04 Traceback (most recent call last):\n")
    kept = serve.keep_log(log, "run-llama.cpp-c4.log")
    assert kept["server_log"] == "<home>/harness/serve-logs/run-llama.cpp-c4.log"
    kept_file = edge_home / "harness" / "serve-logs" / "run-llama.cpp-c4.log"
    assert kept_file.read_text() == log.read_text()
    assert kept["server_errors"] == [
        "1.40.2 E slot launch_slot_: the request exceeds the available context size",
        "ERROR 12-04 Traceback (most recent call last):"]
    # a server that left no log still gives a record its fields
    assert serve.keep_log(tmp_path / "absent.log", "x.log")["server_errors"] == []


def test_the_client_opens_a_connection_per_request():
    """llama-server closes idle connections after 5 s; vLLM's client kept them 60 s and sent
    requests on closed ones. The patched connector never keeps one, and only vLLM's serving
    module sees it."""
    import asyncio

    import aiohttp
    from vllm.benchmarks import serve as vllm_serve

    serve_client.fresh_connection_per_request()
    serve_client.fresh_connection_per_request()  # once is enough; twice changes nothing

    async def build():
        patched = vllm_serve.aiohttp.TCPConnector(limit=2, keepalive_timeout=60, force_close=False)
        plain = aiohttp.TCPConnector(limit=2)
        try:
            return patched.force_close, plain.force_close, vllm_serve.aiohttp.ClientTimeout
        finally:
            await patched.close()
            await plain.close()

    patched, plain, timeout = asyncio.run(build())
    assert patched and not plain
    assert timeout is aiohttp.ClientTimeout


def test_a_stream_cut_after_data_colon_still_parses():
    """vLLM's client strips every network chunk; one that ends at "data: " left "data:{...}",
    which failed the request (llama-server, concurrency 8). Each event parses, and the usage
    beside the choices is still read."""
    import json

    from vllm.benchmarks.lib import endpoint_request_func as erf

    serve_client.read_usage_beside_choices()
    last = {"choices": [{"text": ""}], "usage": {"completion_tokens": 7}}
    stream = ['data: {"choices": [{"text": "a"}]}\n\ndata: ', '{"choices": [{"text": "b"}]}\n\n',
              "data: ", json.dumps(last) + "\n\n", "data: [DONE]\n\n"]
    seen: dict = {}
    serve_client._USAGE.set(seen)
    handler = erf.StreamedResponseHandler()
    messages = [m for chunk in stream for m in handler.add_chunk(chunk.strip().encode())]
    payloads = [m.removeprefix("data: ") for m in messages]
    assert payloads[-1] == "[DONE]"
    assert [json.loads(p)["choices"][0]["text"] for p in payloads[:-1]] == ["a", "b", ""]
    assert seen["completion_tokens"] == 7 and "server_error" not in seen


@pytest.mark.parametrize("terminated", [True, False])
def test_a_server_error_event_fails_the_request_with_the_servers_words(terminated):
    """llama-server ends a failing stream with "error: {...}": never parsed as data, and the
    failed request's error is what the server said, whether or not the event was terminated."""
    import asyncio
    import json

    from vllm.benchmarks.lib import endpoint_request_func as erf

    serve_client.read_usage_beside_choices()
    said = '{"code": 400, "message": "the request exceeds the available context size"}'
    stream = ['data: {"choices": [{"text": "a"}]}\n\n',
              "error: " + said + ("\n\n" if terminated else "")]

    async def request():  # the shape of vLLM's loop: strip, add, parse every message as data
        handler = erf.StreamedResponseHandler()
        out = erf.RequestFuncOutput()
        for chunk in stream:
            for m in handler.add_chunk(chunk.strip().encode()):
                json.loads(m.removeprefix("data: "))
        out.success, out.error = False, "Never received a valid chunk to calculate TTFT."
        return out

    out = asyncio.run(serve_client.counted(request)())
    assert out.error == "server error event: " + said

    async def fine():
        out = await request()
        out.success, out.error = True, ""
        return out

    assert asyncio.run(serve_client.counted(fine)()).error == ""


def test_the_comparison_page_shows_serving_and_task_quality(tmp_path):
    """comparison.md gains ours / llama-server per concurrency and pass@1 per build."""
    import json

    from edge_harness.report.comparison import render

    failing = _record("llama.cpp", "q4_0", 4, 40.0, 800.0)
    failing.extra["failed"] = 1
    for rec in [_record("ours", "w4a16", 8, 100.0, 900.0),
                _record("llama.cpp", "q4_0", 8, 50.0, 1800.0),
                _record("ours", "w4a16", 4, 80.0, 800.0), failing]:
        append_record(tmp_path / "serve.jsonl", rec)
    md = render(tmp_path)
    assert "| smollm2-135m | random | cpu (avx2) | 8 | w4a16 / q4_0 | 2.00 | 0.50 |" in md
    assert ("| smollm2-135m | random | cpu (avx2) | 4 | w4a16 / q4_0 | 2.00 (llama.cpp failed 1) "
            "| 1.00 |") in md
    assert "no tasks.jsonl" in md
    task = {"kind": "humaneval", "model": "m", "engine": "ours", "quant": "w4a16",
            "base": "ours:bf16", "problems": 164, "passed": 41, "pass_at_1": 0.25,
            "pass_at_1_ci95": [0.19, 0.32], "server": {"bits_per_weight": 4.25},
            "decoding": {"max_tokens": 512, "concurrency": 4}, "results": []}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(task) + "\n")
    md = render(tmp_path)
    assert "| m | ours | w4a16 | 4.25 | 0.250 | 0.190–0.320 | 41/164 | 4 |" in md
