"""A locally trained byte-level BPE: the converter refuses its pre-tokenizer, we map it to
'gpt-2', and llama.cpp then tokenizes exactly like HF."""

import pytest

from edge_infer.testing import BPE_TEXT as TEXT
from edge_infer.testing import tiny_bpe_tokenizer


@pytest.fixture(scope="module")
def tiny_bpe_model(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-bpe")
    fast = tiny_bpe_tokenizer(out)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out, fast


def test_unknown_pre_tokenizer_maps_to_gpt2(tiny_bpe_model, tmp_path, edge_home, capfd):
    import llama_cpp
    from gguf import GGUFReader

    from edge_harness.bench.gguf_build import convert

    hf_dir, fast = tiny_bpe_model
    out = convert(hf_dir, tmp_path / "tiny-bf16.gguf", "bf16")
    assert "does not know this BPE pre-tokenizer" in capfd.readouterr().err  # it did refuse
    field = GGUFReader(str(out)).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"
    llm = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    ours = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    assert ours == fast.encode(TEXT, add_special_tokens=False)
