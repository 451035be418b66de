"""MODEL argument -> a folder vLLM loads, the name it is served under, and its profile."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edge_infer import profiles
from edge_infer.errors import EdgeInferError
from edge_infer.models.pull import pull
from edge_infer.models.registry import DEFAULT_MODEL, REGISTRY
from edge_infer.quant.builds import cached_checkpoint


@dataclass(frozen=True)
class Resolved:
    path: Path
    served_name: str
    profile: profiles.Profile


def default_build(name: str, profile: profiles.Profile) -> Path:
    """The profile's default 4-bit build of a registry model, built once and cached."""
    return cached_checkpoint(name, profile.quant)


def resolve(model: str | None, profile_arg: str | None = None) -> Resolved:
    if model is None:
        prof = profiles.load(profile_arg or DEFAULT_MODEL, required=bool(profile_arg))
        path = default_build(DEFAULT_MODEL, prof)
        return Resolved(path, f"{DEFAULT_MODEL}-{prof.quant.scheme}", prof)
    if model in REGISTRY:
        prof = profiles.load(profile_arg or model, required=bool(profile_arg))
        return Resolved(pull(model).hf_dir, model, prof)
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(sorted(REGISTRY))
        raise EdgeInferError(f"model {model!r}: no such folder, and not a known model ({known})")
    if not (path / "config.json").is_file():
        raise EdgeInferError(f"{path} is not a HF model folder (no config.json)")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise EdgeInferError(f"{path}/config.json is not valid JSON: {exc}") from None
    prof = profiles.load(profile_arg, required=True) if profile_arg else profiles.Profile()
    return Resolved(path.resolve(), path.name, prof)
