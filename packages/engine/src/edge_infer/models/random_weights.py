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
from pathlib import Path

from tqdm import tqdm

SHARD_BYTES = 1 << 30


def qwen3_tensors(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (nq * d, h)
        yield f"{p}.self_attn.k_proj.weight", (nkv * d, h)
        yield f"{p}.self_attn.v_proj.weight", (nkv * d, h)
        yield f"{p}.self_attn.o_proj.weight", (h, nq * d)
        yield f"{p}.self_attn.q_norm.weight", (d,)
        yield f"{p}.self_attn.k_norm.weight", (d,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (f, h)
        yield f"{p}.mlp.up_proj.weight", (f, h)
        yield f"{p}.mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h)


TENSOR_LAYOUTS = {"qwen3": qwen3_tensors}


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(seed: int, name: str, shape: tuple[int, ...]):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def build_random(config: dict, seed: int, tokenizer_dir: Path, out_dir: Path) -> None:
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
                tensors[name] = make_tensor(seed, name, shape)
                weight_map[name] = fname
                bar.update(2 * numel[idx])
            save_file(tensors, out_dir / fname, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 2 * sum(numel)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps({**config, "seed": seed}, indent=2))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, out_dir / f.name)
