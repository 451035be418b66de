"""A real `edge-infer serve` process on a free loopback port, driven by the openai client."""

import json
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import openai_parity
import pytest

from edge_infer.serve import process
from edge_infer.testing import environ

API_KEY = "test-key-not-secret"
MODEL = "smollm2-135m-w4a16"
START_TIMEOUT = 900  # vLLM's start is 1-3 min here, slower when the machine is busy


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`edge-infer serve ARGS` on a free port, once /health answers."""
    try:
        return process.start(args, log, START_TIMEOUT)
    except process.ServeFailed as exc:
        pytest.fail(str(exc))


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    log = tmp_path / "serve.log"
    proc, base = process.spawn(["--no-such-option"], log)
    with pytest.raises(process.ServeFailed, match="exited with 2(.|\n)*--no-such-option"):
        process.wait_healthy(proc, base, START_TIMEOUT, log)
    process.stop(proc)  # already gone: a no-op


def test_any_server_command_is_launched_pinned_and_named_in_its_error(tmp_path):
    """`launch` is what llama-server starts through too: its own process group, pinned to the
    given cores from birth, and the error names the server it was told."""
    import os
    import sys

    log = tmp_path / "other.log"
    code = "import os, sys; print(sorted(os.sched_getaffinity(0)), os.getpgid(0) == os.getpid()); sys.exit(3)"
    proc = process.launch([sys.executable, "-c", code], log, None, cores=[0])
    with pytest.raises(process.ServeFailed, match="llama-server exited with 3(.|\n)*\\[0\\] True"):
        process.wait_healthy(proc, f"http://127.0.0.1:{process.free_port()}", 60, log, what="llama-server")
    assert os.sched_getaffinity(0) != {0} or os.cpu_count() == 1  # only the child was pinned


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, base = start(["--api-key", API_KEY], log)
    yield base, log, proc
    process.stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def raw(base: str, path: str, body: bytes | None, key: str | None = API_KEY) -> tuple[int, dict]:
    return openai_parity.request(base, path, body, key)


def test_models_lists_the_default(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens == 8


def test_chat_uses_the_chat_template(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=16, temperature=0,
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip()
    # the template wraps the turn: the prompt is far longer than the 6 words of the question
    assert r.usage.prompt_tokens > 10


def test_streaming_chat(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12, temperature=0, stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3 and text.strip()
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def get(base: str, path: str, key: str | None = API_KEY) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_and_metrics(server):
    base = server[0]
    assert get(base, "/health", key=None)[0] == 200
    status, body = get(base, "/metrics")
    assert status == 200 and b"vllm:" in body


@pytest.mark.parametrize("case", openai_parity.BAD_CASES)
def test_bad_request_is_4xx_with_message(server, client, case):
    openai_parity.bad_input(case, server[0], API_KEY, client, MODEL)


def test_api_key_is_enforced(server):
    openai_parity.key_required(server[0], API_KEY, MODEL)


def test_the_key_is_not_in_argv_or_the_log(server):
    import psutil

    base, log, proc = server
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        assert API_KEY not in " ".join(p.cmdline()), p.cmdline()
    assert API_KEY not in log.read_text()
    assert raw(base, "/tokenize", json.dumps({"model": MODEL, "prompt": "hi"}).encode())[0] == 200


def vllm_app(serve_args: list[str]):
    """vLLM's FastAPI app as `edge-infer serve SERVE_ARGS` configures it, built in-process
    without an engine: the routes and middleware are real, the handlers have no state."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from edge_infer.cli import build_parser
    from edge_infer.serve.cli import serve_command

    cmd, env = serve_command(build_parser().parse_args(["serve", *serve_args]))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    # every task's routers, so that a route any model would get is listed
    tasks = ("generate", "transcription", "realtime", "embed", "classify", "score", "render")
    with environ(**{k: v for k, v in env.items() if k.startswith(("EDGE_INFER_", "VLLM_API"))}):
        return build_app(args, supported_tasks=tasks)


def every_route(app):
    """(kind, path) of every route and mount of the app, path parameters filled in."""
    import re

    from starlette.routing import Mount, WebSocketRoute

    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        if isinstance(route, WebSocketRoute):
            yield "websocket", path, None
        elif isinstance(route, Mount):
            yield "http", path + "/", "GET"
        else:
            for method in sorted(route.methods or []):
                yield "http", path, method


@pytest.mark.parametrize("metrics_open", [False, True], ids=["default", "metrics-open"])
def test_every_route_needs_the_key(edge_home, monkeypatch, metrics_open):
    """Lists the routes vLLM registers and calls each without a key: only /health and /ping
    (and /metrics with --metrics-open) answer; a route a vLLM upgrade adds is guarded too."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from edge_infer.serve import auth

    monkeypatch.setenv(auth.KEY_ENV, API_KEY)
    app = vllm_app(["--dry-run", *(["--metrics-open"] if metrics_open else [])])
    client = TestClient(app, raise_server_exceptions=False)
    routes = list(every_route(app))
    assert {"/tokenize", "/invocations", "/metrics", "/v1/completions"} <= {p for _, p, _ in routes}
    opened = []
    for kind, path, method in routes:
        if kind == "websocket":
            with pytest.raises(WebSocketDisconnect) as exc, client.websocket_connect(path):
                pass
            assert exc.value.code == 1008, path
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status = client.request(method, path, headers=headers, json={}).status_code
            if status != 401:
                opened.append((method, path, status))
    expected_open = {p for p in auth.OPEN} | ({"/metrics", "/metrics/"} if metrics_open else set())
    assert {p for _, p, _ in opened} == expected_open, opened
    # and the key opens a guarded route (the handler then fails for want of an engine: not 401)
    status = client.get("/version", headers={"Authorization": f"Bearer {API_KEY}"}).status_code
    assert status != 401


def test_overload_beyond_max_num_seqs_waits_and_drops_nothing(server, client):
    """64 concurrent streaming clients against max_num_seqs 16: the excess wait in vLLM's queue
    (seen in its waiting gauge) and every one finishes."""
    import re
    import threading

    base = server[0]
    waiting, stop_sampling = [0.0], threading.Event()

    def sample():
        while not stop_sampling.is_set():
            status, body = get(base, "/metrics")
            for m in re.finditer(rb"^vllm:num_requests_waiting\{[^}]*\} ([0-9.e+]+)$", body, re.M):
                waiting[0] = max(waiting[0], float(m.group(1)))
            time.sleep(0.1)

    def one(i: int) -> tuple[str, str | None]:
        stream = client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))
    finally:
        stop_sampling.set()
        sampler.join()
    assert all(finish == "length" and text for text, finish in results), results
    assert waiting[0] > 0, "64 clients never queued: the test did not overload the server"


def test_short_soak_loses_nothing(server):
    """20 s of `nox -s soak`'s mix (bad requests, cancelled streams, long and short prompts):
    every request is answered, cancelled or rejected as intended, and the server answers after."""
    from edge_infer.serve import soak

    base = server[0]
    tally = soak.run_load(base, API_KEY, MODEL, clients=8, seconds=20, seed=0, max_requests=400)
    rec = soak.summary(tally, 8, 20, 0)
    assert rec["failed"] == 0, rec["failures"]
    assert rec["answered"] > 0 and rec["sent"] == rec["answered"] + rec["cancelled"] + rec["bad_sent"]
    assert rec["bad_rejected"] == rec["bad_sent"]
    assert soak.answers(base, API_KEY, MODEL)


def test_eight_concurrent_streams_complete(client):
    def one(i: int) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=16, temperature=0, stream=True,
        )
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(text and finish in ("length", "stop") for text, finish in results)


def test_kernel_is_logged(server):
    log = server[1]
    text = log.read_text()
    assert "quantization=edge_w4" in text
    # the kernel the dispatcher picks on this CPU for smollm2's first layer (qkv: 960 x 576, g64)
    from edge_infer.kernels import w4a16

    assert f"edge_w4 w4a16: kernel {w4a16.select(960, 576, 64).name}" in text



def test_serve_runs_the_worker_in_the_engine_process(edge_home):
    """vLLM's CPU backend otherwise puts its worker in a third process behind shared-memory
    queues of 160 + 240 MiB, which a container's default 64 MiB /dev/shm cannot hold (so
    `docker run edge-infer serve` would fail), and which costs a process start and an IPC hop
    per step. serve asks for the in-process executor, which the CPU platform keeps only with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (the API server still runs the engine core apart)."""
    from edge_infer.cli import build_parser
    from edge_infer.serve.cli import serve_command

    args = build_parser().parse_args(["serve", "--dry-run"])
    cmd, env = serve_command(args)
    i = cmd.index("--distributed-executor-backend")
    assert cmd[i + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("check", list(openai_parity.CHECKS))
def test_openai_parity(client, check):
    openai_parity.run(check, client, MODEL)


@pytest.mark.heavy  # pulls and quantizes a second model (about 5 minutes)
def test_tool_calls_are_parsed_for_qwen25_coder(edge_home, tmp_path):
    """The qwen2.5-coder profile names vLLM's hermes parser, so `tool_choice: auto` is accepted
    and a tool call comes back as `tool_calls`, never as a server error."""
    proc, base = start(["qwen2.5-coder-0.5b", "--max-model-len", "2048"], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        out = client.chat.completions.create(
            model="qwen2.5-coder-0.5b", tools=tools, tool_choice="auto", max_tokens=64,
            temperature=0, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        msg = out.choices[0].message
        if msg.tool_calls:
            call = msg.tool_calls[0]
            assert call.function.name == "get_weather", call
            assert isinstance(json.loads(call.function.arguments), dict), call
            assert out.choices[0].finish_reason == "tool_calls"
        else:
            assert msg.content and "<tool_call>" not in msg.content, msg
    finally:
        process.stop(proc)


def test_a_killed_engine_core_is_a_nonzero_exit(server):
    """Runs last in this module (it ends the shared server). vLLM alone exits 0 when its engine
    core dies; `edge-infer serve` must exit non-zero so that a supervisor restarts it."""
    import psutil

    from edge_infer.serve.vllm_main import ENGINE_DIED

    proc = server[2]
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "no engine core process under the API server"
    for child in children:
        child.kill()
    assert proc.wait(timeout=120) == ENGINE_DIED, server[1].read_text()[-2000:]
