"""The load generator of `bench serve`: vLLM's own serving benchmark client (`vllm bench
serve`), called in a pinned worker (isolation.worker's `call`) so that vLLM is imported once
for every concurrency, and the worker sits idle between measurements for the guard.

`run` takes `vllm bench serve`'s own command-line arguments and returns the figures a record
keeps; the per-request lists come back from vLLM (`--save-detailed` semantics, nothing is
written to disk) and are reduced here.

One adaptation, for llama-server: its /v1/completions stream puts `usage` into the last chunk
beside a (empty) choice, where vLLM's client only reads `usage` from a chunk without choices.
The client then counts output tokens by re-tokenizing the text, which miscounts (badly for
random-weight models, whose text does not round-trip). `read_usage_beside_choices` makes the
client take the server's own count from either kind of chunk; timings are untouched. Every
request's count is then checked against the length it asked for (EOS is ignored, so a
complete answer has exactly that many tokens): `short_requests` says how many fell short.

And one for framing: vLLM's client strips each network chunk before it parses the stream, so a
chunk that ends at an event's "data: " loses the space, the event reads "data:{...}" and the
request fails with a JSONDecodeError (llama-server at concurrency 8 split one so). The handler
gives the space back when the buffer holds nothing but that cut "data:".

And one for errors: llama-server reports a request that fails mid-stream (after its 200) as an
SSE event "error: {...}", not "data: ...". vLLM's client then fails the request with a
JSONDecodeError, or, when the event is the stream's unterminated end (or a "data:" event of an
error alone), "Never received a valid chunk"; either way the server's own words were lost. The
handler holds such an event back, and the failed request's error becomes "server error event:
<what the server said>".

And one for connections: vLLM's client keeps idle connections for 60 s, while llama-server's
HTTP library closes one after 5 s idle or 5 requests. A request sent on a connection the
server had just closed failed with "Server disconnected" and counted as an error of the
server. `fresh_connection_per_request` gives every request its own connection, for both
servers alike (a connect on localhost is some 0.1 ms, inside TTFT for both).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import json
from typing import Any

# vLLM's result keys -> ours; percentiles are asked for with --metric-percentiles 50,99
FIGURES = {"output_throughput": "output_tok_s", "request_throughput": "requests_s",
           "total_token_throughput": "total_tok_s", "duration": "duration_s",
           "completed": "completed", "failed": "failed",
           "total_input_tokens": "total_input_tokens",
           "total_output_tokens": "total_output_tokens",
           "max_concurrent_requests": "max_concurrent_requests"}
LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "p50", "p99")


_USAGE: contextvars.ContextVar[dict] = contextvars.ContextVar("edge_serve_usage")


def read_usage_beside_choices() -> None:
    """Patch vLLM's client (once per process) to take `usage.completion_tokens` from any
    stream chunk that carries it (see the module's docstring)."""
    from vllm.benchmarks.lib import endpoint_request_func as erf

    if getattr(erf, "_edge_usage_patched", False):
        return

    class Handler(erf.StreamedResponseHandler):
        def add_chunk(self, chunk_bytes: bytes) -> list[str]:
            if self.buffer == "data:":  # the last chunk ended at "data: ", stripped by the caller
                chunk_bytes = b" " + chunk_bytes
            seen = _USAGE.get(None)
            if seen is None:
                seen = {}
            messages = []
            for m in super().add_chunk(chunk_bytes):
                if m.startswith("error:"):  # the server's own error event: kept, not parsed
                    seen["server_error"] = m.removeprefix("error:").strip()
                    continue
                messages.append(m)
                data = m.removeprefix("data: ")
                if ('"usage"' in data or '"error"' in data) and data != "[DONE]":
                    event = json.loads(data)
                    usage = event.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        seen["completion_tokens"] = usage["completion_tokens"]
                    if event.get("error") and not event.get("choices"):  # as data, not event
                        seen["server_error"] = json.dumps(event["error"])
            seen["tail"] = self.buffer  # an error event the stream ended without terminating
            return messages

    erf.StreamedResponseHandler = Handler
    for name in ("openai", "vllm"):
        erf.ASYNC_REQUEST_FUNCS[name] = counted(erf.ASYNC_REQUEST_FUNCS[name])
    erf._edge_usage_patched = True


def counted(fn):
    """A request function of vLLM's client, with the server's token count and error words (see
    read_usage_beside_choices) put into its output."""
    @functools.wraps(fn)
    async def request(*args, **kwargs):
        seen: dict = {}
        _USAGE.set(seen)  # each request runs in its own task, with its own context
        output = await fn(*args, **kwargs)
        if output.success and not output.output_tokens and "completion_tokens" in seen:
            output.output_tokens = seen["completion_tokens"]
        tail = seen.get("tail", "")
        said = seen.get("server_error") or (tail.removeprefix("error:").strip()
                                            if tail.startswith("error:") else "")
        if not output.success and said:
            output.error = f"server error event: {said}"
        return output
    return request


def fresh_connection_per_request() -> None:
    """Make `vllm bench serve`'s connector close each connection after its request (see the
    module's docstring); only vLLM's serving benchmark module sees the change."""
    import aiohttp
    from vllm.benchmarks import serve

    if getattr(serve, "_edge_fresh_connections", False):
        return

    def connector(*args, **kwargs):
        kwargs.pop("keepalive_timeout", None)  # aiohttp refuses it beside force_close
        kwargs["force_close"] = True  # whatever vLLM asked for
        return aiohttp.TCPConnector(*args, **kwargs)

    class Aiohttp:
        TCPConnector = staticmethod(connector)

        def __getattr__(self, name: str):
            return getattr(aiohttp, name)

    serve.aiohttp = Aiohttp()
    serve._edge_fresh_connections = True


def run(argv: list[str]) -> dict[str, Any]:
    import vllm
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    read_usage_beside_choices()
    fresh_connection_per_request()
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([*argv, "--save-detailed", "--disable-tqdm"])
    # the output lengths asked for: the client's own sampling, seeded, drawn again here
    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    asked = [r.expected_output_len for r in get_samples(copy.copy(args), tokenizer)]
    result = main(args)
    got = result.get("output_lens") or []
    short = sum(1 for a, g in zip(asked, got, strict=False) if g != a) + abs(len(asked) - len(got))
    return {"client": f"vllm bench serve (vllm {vllm.__version__})", **summarize(result),
            "asked_output_tokens": sum(asked), "short_requests": short}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one `vllm bench serve` result: throughputs, latency percentiles (ms),
    request counts, the lengths actually served, and each distinct error with its count."""
    out: dict[str, Any] = {ours: result.get(theirs) for theirs, ours in FIGURES.items()}
    for metric in LATENCIES:
        out[f"{metric}_ms"] = {s: result.get(f"{s}_{metric}_ms") for s in STATS
                               if result.get(f"{s}_{metric}_ms") is not None}
    errors: dict[str, int] = {}
    for e in result.get("errors") or []:
        if e:
            line = e.strip().splitlines()[-1][:300]  # a traceback's last line says what failed
            errors[line] = errors.get(line, 0) + 1
    out["errors"] = errors
    out["requests"] = len(result.get("errors") or [])
    for name in ("input_lens", "output_lens"):
        lens = [n for n in result.get(name) or [] if n]
        out[name.removesuffix("s")] = {"min": min(lens), "max": max(lens)} if lens else {}
    return out
