"""Each build behind its engine's own OpenAI-compatible server, as a user would serve it, and the
one completion request every build gets.

A server starter per engine (STARTERS) is a context manager: given the model and the build, it
starts the server, waits until it answers, yields a `Served` (base URL, the model name to send,
facts for the record) and stops it. `attached` takes a server someone else started (a base URL),
so any engine with an OpenAI completion API can be scored without a starter here.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edge_harness.runners.base import ModelRef
from edge_infer.api import REGISTRY, ServeFailed, serve_start, serve_stop

START_TIMEOUT_S = 900  # a cold start quantizes nothing (built before), but vLLM init is slow here


@dataclass
class Served:
    base_url: str
    model: str  # the name requests carry
    facts: dict = field(default_factory=dict)


# (model, quant, log, slots=N): N requests may be in flight at once
Starter = Callable[..., contextlib.AbstractContextManager[Served]]


@contextlib.contextmanager
def ours(model: ModelRef, quant: str, log: Path, slots: int = 1) -> Iterator[Served]:
    """`edge-infer serve` of the build's folder (bf16: the HF folder itself), under the model's
    profile (whose max_num_seqs bounds `slots`), prefix caching off (each problem is scored from
    a cold cache, like llama.cpp's)."""
    from edge_harness.runners.ours import OursRunner

    build = OursRunner.prepare(model, quant)  # quantizes once into the checkpoint cache
    name = f"{model.name}-{quant}"
    args = [build.path, "--served-model-name", name, "--no-prefix-caching"]
    if model.name in REGISTRY:
        args += ["--profile", model.name]
    proc, base = serve_start(args, log, START_TIMEOUT_S)
    try:
        yield Served(base, name, {"server": "edge-infer serve", "slots": slots,
                                  "build_path": Path(build.path).name,
                                  "bits_per_weight": round(build.bits_per_weight, 4),
                                  "activations": _activations(log)})
    finally:
        serve_stop(proc)


def _activations(log: Path) -> str | None:
    """The activation dtype `edge-infer serve` chose (its first log line says it)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("edge-infer serve: activations "):
            return line.split()[3].rstrip(":")
    return None


@contextlib.contextmanager
def llamacpp(model: ModelRef, quant: str, log: Path, slots: int = 1) -> Iterator[Served]:
    """llama.cpp's own `llama-server` on the build's GGUF, `slots` parallel slots of 4096 tokens
    each, from the tools we build from
    the pinned llama-cpp-python sdist (bench/llama_tools.py, whose launcher the serving benchmark
    shares)."""
    from edge_harness.bench import llama_tools
    from edge_harness.runners.llamacpp import LlamaCppRunner

    build = LlamaCppRunner.prepare(model, quant)  # the GGUF (converted / quantized once)
    name = f"{model.name}-{quant}"
    proc, base, _ = llama_tools.start_server(build.path, name, log, slots=slots, ctx_per_slot=4096,
                                             timeout=START_TIMEOUT_S)
    try:
        binary = llama_tools.tool_path(llama_tools.LLAMA_SERVER)
        yield Served(base, name, {"server": llama_tools.LLAMA_SERVER, "slots": slots,
                                  **llama_tools.tool_version(binary),
                                  "bits_per_weight": round(build.bits_per_weight, 4)})
    finally:
        serve_stop(proc)


STARTERS: dict[str, Starter] = {"ours": ours, "llama.cpp": llamacpp}


@contextlib.contextmanager
def attached(base_url: str) -> Iterator[Served]:
    """A server started elsewhere: the first model its /v1/models lists."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=30) as r:
            name = json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ServeFailed(f"{base_url}/v1/models did not list a model: {exc}") from None
    yield Served(base_url.rstrip("/"), name, {"server": f"attached {base_url}"})


def complete(served: Served, prompt: str, max_tokens: int, stop: tuple[str, ...],
             timeout: float = 600) -> dict:
    """One greedy completion: {"text", "finish_reason", "completion_tokens", "seconds"}."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": list(stop)}
    req = urllib.request.Request(f"{served.base_url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.load(r)
    except urllib.error.HTTPError as exc:
        raise ServeFailed(f"{served.base_url}/v1/completions answered {exc.code}: "
                          f"{exc.read()[:300]!r}") from None
    choice = data["choices"][0]
    return {"text": choice["text"], "finish_reason": choice.get("finish_reason"),
            "completion_tokens": (data.get("usage") or {}).get("completion_tokens"),
            "seconds": round(time.monotonic() - t0, 3)}
