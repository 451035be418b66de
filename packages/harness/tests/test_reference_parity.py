"""The pulled HF folder and the original GGUF are the same model (transformers vs llama.cpp).

The HF folder holds the GGUF's Q4_1 weights dequantized to bf16; llama.cpp runs the Q4_1
weights with 8-bit activations. So they agree closely but not bit for bit: greedy output
matches for a stretch, then may diverge on a near-tie. A wrong conversion (a transposed or
permuted tensor, a wrong norm epsilon, a wrong RoPE) breaks both checks at once.
"""

import numpy as np
import pytest
import torch

from edge_infer.testing import environ

CHAT = "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n"
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was "
    "the season of Light, it was the season of Darkness."
)
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    from edge_infer.models.pull import pull

    with environ(EDGE_INFER_HOME=str(tmp_path_factory.mktemp("parity-home"))):
        yield pull("smollm2-135m")


@pytest.fixture(scope="module")
def engines(pulled):
    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pulled.hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(pulled.hf_dir, dtype=torch.float32)
    # flash attention pinned off, one thread: llama.cpp's numerics are then reproducible
    gg = llama_cpp.Llama(model_path=str(pulled.gguf_path), n_ctx=512, n_threads=1,
                         logits_all=True, flash_attn=False, verbose=False)
    yield tok, hf, gg
    gg.close()


def test_tokenizers_agree(engines):
    tok, _, gg = engines
    for text in (CHAT, TEXT):
        assert tok(text)["input_ids"] == gg.tokenize(text.encode(), add_bos=False, special=True)


def test_same_greedy_continuation(engines):
    tok, hf, gg = engines
    ids = tok(CHAT)["input_ids"]
    with torch.no_grad():
        ours = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
    ours = ours[0, len(ids):].tolist()
    theirs = []
    for t in gg.generate(ids, top_k=1, temp=0.0, reset=True):
        theirs.append(t)
        if len(theirs) == GREEDY_TOKENS:
            break
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))


def test_logits_agree_over_a_paragraph(engines):
    tok, hf, gg = engines
    ids = tok(TEXT)["input_ids"]
    gg.reset()
    gg.eval(ids)
    theirs = torch.tensor(np.array(gg.scores[: len(ids)]), dtype=torch.float32)
    with torch.no_grad():
        ours = hf(torch.tensor([ids])).logits[0].float()
    same_top = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    p, q = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert same_top >= 0.9, same_top
    assert kl.mean().item() < 0.02, kl.mean().item()
