"""Random-weight checkpoints of real shape, deterministic from a seed, for speed work.

Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's
values do not depend on the order or number of the others. Weights are N(0, 0.02) like
HF's default init, norms are ones; written as bf16 safetensors shard by shard, so building
a 1.7B model never holds more than one shard in memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from tqdm import tqdm

SHARD_BYTES = 1 << 30


def _decoder_tensors(cfg: dict, embedding: str, attention: list[tuple[str, tuple[int, ...]]]
                     ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A pre-norm decoder's tensors in checkpoint order; `attention` is one layer's
    self_attn tensors (name, shape), the one part the architectures here do differently."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    yield embedding, (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        for name, shape in attention:
            yield f"{p}.self_attn.{name}.weight", shape
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (f, h)
        yield f"{p}.mlp.up_proj.weight", (f, h)
        yield f"{p}.mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h)


def _heads(cfg: dict) -> tuple[int, int, int, int]:
    """(hidden, head_dim, query heads, KV heads)."""
    return (cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"])


def qwen3_tensors(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3's: separate q/k/v/o projections and per-head RMSNorms of q and k."""
    h, d, nq, nkv = _heads(cfg)
    attention = [("q_proj", (nq * d, h)), ("k_proj", (nkv * d, h)), ("v_proj", (nkv * d, h)),
                 ("o_proj", (h, nq * d)), ("q_norm", (d,)), ("k_norm", (d,))]
    return _decoder_tensors(cfg, "model.embed_tokens.weight", attention)


def spark_tensors(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Spark-X2.5's: fused q_k_v_proj ([q; k; v] rows), the head-wise gate g_proj (one row per
    head), out_proj; the embedding is model.embedding."""
    h, d, nq, nkv = _heads(cfg)
    attention = [("q_k_v_proj", ((nq + 2 * nkv) * d, h)), ("g_proj", (nq, h)),
                 ("out_proj", (h, nq * d))]
    return _decoder_tensors(cfg, "model.embedding.weight", attention)


TENSOR_LAYOUTS = {"qwen3": qwen3_tensors, "spark2_5": spark_tensors}


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(seed: int, name: str, shape: tuple[int, ...], std: float = 0.02,
                norm_std: float = 0.0):
    """N(0, std) weights; norms are ones (+ N(0, norm_std) where a test wants them to matter)."""
    import torch

    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    if name.endswith("norm.weight"):
        if not norm_std:
            return torch.ones(shape, dtype=torch.bfloat16)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32) * norm_std
        return (1.0 + noise).to(torch.bfloat16)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch.bfloat16)


def pad_tokenizer(out_dir: Path, vocab_size: int, special_tokens: tuple[str, ...] = (),
                  bos: str | None = None, eos: str | None = None) -> dict[str, int]:
    """Grow the HF fast tokenizer in `out_dir` (tokenizer.json) to exactly `vocab_size` ids.

    `special_tokens` are added first (the model's own markers, e.g. a chat format's); the rest
    are `<|reserved_N|>` vocabulary entries that no merge produces, so encoding is unchanged
    and every id a random model can emit still decodes. Returns the special tokens' ids.
    """
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    added = data["added_tokens"]
    taken = set(vocab.values()) | {t["id"] for t in added}
    ids = {}
    for token in dict.fromkeys([*special_tokens, *(t for t in (bos, eos) if t)]):
        if token in vocab:
            ids[token] = vocab[token]
            continue
        ids[token] = max(taken) + 1
        taken.add(ids[token])
        vocab[token] = ids[token]
        added.append({"id": ids[token], "content": token, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    if max(taken) >= vocab_size:
        raise ValueError(f"tokenizer has {max(taken) + 1} ids, more than vocab_size {vocab_size}")
    for i in range(max(taken) + 1, vocab_size):
        vocab[f"<|reserved_{i}|>"] = i
    path.write_text(json.dumps(data, ensure_ascii=False))
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for key, token in (("bos_token", bos), ("eos_token", eos)):
        if token is not None:
            tok_cfg[key] = token
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return ids


def build_random(config: dict, seed: int, tokenizer_dir: Path, out_dir: Path, *,
                 special_tokens: tuple[str, ...] = (), bos: str | None = None,
                 eos: str | None = None, chat_template: str | None = None,
                 std: float = 0.02, norm_std: float = 0.0) -> None:
    """A bf16 safetensors checkpoint of `config`'s shapes, with the tokenizer of
    `tokenizer_dir` (padded to the config's vocab when `special_tokens`/bos/eos are given)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    layout = list(TENSOR_LAYOUTS[config["model_type"]](config))
    numel = [int.__mul__(*s) if len(s) == 2 else s[0] for _, s in layout]
    shards: list[list[int]] = [[]]
    size = 0
    for idx, n in enumerate(numel):
        if size and size + 2 * n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(idx)
        size += 2 * n
    weight_map = {}
    with tqdm(total=2 * sum(numel), unit="B", unit_scale=True, desc="random weights") as bar:
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for idx in shard:
                name, shape = layout[idx]
                tensors[name] = make_tensor(seed, name, shape, std, norm_std)
                weight_map[name] = fname
                bar.update(2 * numel[idx])
            save_file(tensors, out_dir / fname, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 2 * sum(numel)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, out_dir / f.name)
    # transformers_version: without it, transformers 5 suspects any local tokenizer of an
    # old Mistral regex bug and warns on every load.
    config = {**config, "seed": seed, "transformers_version": version("transformers")}
    if special_tokens or bos or eos:
        ids = pad_tokenizer(out_dir, config["vocab_size"], special_tokens, bos, eos)
        config.update({f"{k}_token_id": ids[t] for k, t in (("bos", bos), ("eos", eos)) if t})
    if chat_template is not None:
        (out_dir / "chat_template.jinja").write_text(chat_template)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
