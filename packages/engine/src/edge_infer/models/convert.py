"""GGUF -> HF folder (bf16 safetensors), with transformers' own GGUF loader.

transformers dequantizes the GGUF tensors (through the `gguf` package) into a HF model.
`save_pretrained` refuses a model loaded from GGUF, so a fresh model is built from the same
config and given the state dict. The tokenizer (and its chat template) also comes from the
GGUF; where the GGUF carries no template, ChatML is written, since all our GGUF sources are
ChatML-trained (SmolLM2, Qwen2.5).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("dequantizing %s with transformers' GGUF loader", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    config = loaded.config
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF -> HF state dict mismatch: missing {missing}, extra {unexpected}")
    del loaded
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # The weights are plain bf16 now: a leftover `quantization_config: gguf` would make
    # vLLM and transformers treat the folder as GGUF-quantized.
    cfg_path = out_dir / "config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(data, indent=2) + "\n")
