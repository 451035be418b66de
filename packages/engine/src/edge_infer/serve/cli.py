"""`edge-infer serve [MODEL]` and `edge-infer generate MODEL PROMPT`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from edge_infer.errors import UsageError
from edge_infer.kernels.cpu import activation_dtype
from edge_infer.serve import auth
from edge_infer.serve.resolve import resolve
from edge_infer.serve.runtime import vllm_env


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port {port} out of range 1..65535")
    return port


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (vLLM + our plugin); no MODEL = the embedded default",
        description="Serve MODEL (a folder, or a name from `edge-infer models list`) with "
        "vLLM's OpenAI-compatible server and its edge profile. With no MODEL, serves "
        "smollm2-135m quantized to W4A16 (built on first use).",
    )
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="folder or model name (see `models list`); default: the default model's 4-bit build")
    p.add_argument("--host", default=os.environ.get("EDGE_INFER_HOST", "127.0.0.1"),
                   help="bind address (default 127.0.0.1, or EDGE_INFER_HOST; the image sets 0.0.0.0)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key",
                   help=f"require this bearer key on every route but {', '.join(auth.OPEN)}; "
                   f"prefer {auth.KEY_ENV} in the environment (argv is visible to `ps`)")
    p.add_argument("--metrics-open", action="store_true",
                   help="serve /metrics without the key (for a scraper inside a trusted network)")
    p.add_argument("--profile", help="profile name or .toml file (default: the model's own)")
    p.add_argument("--threads", type=int, help="OpenMP threads (default: every allowed core)")
    p.add_argument("--max-model-len", type=int, help="override the profile's context length")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="override the profile (on for serving by default)")
    p.add_argument("--served-model-name", help="name clients use (default: from MODEL)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    p.set_defaults(func=cmd_serve)


def serve_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    r = resolve(args.model, args.profile)
    s = r.profile.serve
    max_len = args.max_model_len or s.max_model_len
    if max_len <= 0:
        raise UsageError(f"--max-model-len {max_len}: must be positive")
    prefix = s.prefix_caching if args.prefix_caching is None else args.prefix_caching
    try:
        dtype = activation_dtype(s.dtype)
    except ValueError as exc:
        raise UsageError(f"profile {r.profile.name}: serve.{exc}") from None
    cmd = [
        # vLLM's OpenAI server, wrapped so that a dead engine is a non-zero exit
        sys.executable, "-m", "edge_infer.serve.vllm_main",
        "--model", str(r.path),
        "--served-model-name", args.served_model_name or r.served_name,
        "--host", args.host, "--port", str(args.port),
        "--dtype", dtype,
        "--max-model-len", str(max_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
        # OpenAI-strict checks vLLM does not make (an unknown chat role is a 400)
        "--middleware", "edge_infer.serve.strict.check_request",
        # the key on every route, not only vLLM's /v1; added last, so it runs first
        "--middleware", "edge_infer.serve.auth.RequireKey",
        # The worker in the engine-core process: no third process and no shared-memory queues
        # (160 + 240 MiB of /dev/shm, more than a container's default 64 MiB). vLLM's CPU
        # platform keeps "uni" only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (set below); the API
        # server still runs the engine core in its own process.
        "--distributed-executor-backend", "uni",
    ]
    if s.enforce_eager:
        cmd.append("--enforce-eager")
    if s.tool_call_parser:
        # `tool_choice: "auto"` needs both flags; the parser is the model family's format
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
    if r.profile.chat.template:
        fd, path = tempfile.mkstemp(prefix="edge-infer-chat-", suffix=".jinja")
        with os.fdopen(fd, "w") as f:
            f.write(r.profile.chat.template)
        cmd += ["--chat-template", path]
    env = {**os.environ, **vllm_env(r.profile, args.threads, in_process=True)}
    # The key travels in the environment, never in argv. vLLM's own check reads VLLM_API_KEY
    # (it guards /v1 only); ours reads EDGE_INFER_API_KEY and guards the rest too.
    key = api_key(args)
    for name in (auth.KEY_ENV, "VLLM_API_KEY"):
        env.pop(name, None)
        if key:
            env[name] = key
    env[auth.METRICS_OPEN_ENV] = "1" if args.metrics_open else "0"
    return cmd, env


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else EDGE_INFER_API_KEY, else VLLM_API_KEY (vLLM's own name)."""
    return args.api_key or os.environ.get(auth.KEY_ENV) or os.environ.get("VLLM_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> int:
    cmd, env = serve_command(args)
    keyed = f"{auth.KEY_ENV}=*** " if env.get(auth.KEY_ENV) else ""
    if not keyed:
        print(f"edge-infer serve: WARNING: no API key: anyone who can reach {args.host}:"
              f"{args.port} can use this server; set {auth.KEY_ENV} to require one",
              file=sys.stderr, flush=True)
    if args.dry_run:
        print(keyed + " ".join(cmd))
        return 0
    dtype = cmd[cmd.index("--dtype") + 1]
    print(f"edge-infer serve: activations {dtype}: {keyed}" + " ".join(cmd[2:]),
          file=sys.stderr, flush=True)
    # exec: signals reach vLLM directly, and no parent lingers after it exits
    os.execve(sys.executable, cmd, env)


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="one-off completion through vLLM (no server)")
    p.add_argument("model", metavar="MODEL", help="folder or model name (see `models list`)")
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--profile", help="profile name or .toml file (default: the model's own)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens <= 0:
        raise UsageError(f"--max-tokens {args.max_tokens}: must be positive")
    r = resolve(args.model, args.profile)
    os.environ.update(vllm_env(r.profile))
    from edge_infer.serve.offline import generate

    print(generate(r, args.prompt, args.max_tokens, args.temperature, args.chat))
    return 0
