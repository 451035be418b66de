"""Spark-X2.5: llama.cpp (its own Spark2.5 support, b10830+) and our vLLM class run the same
weights and agree.

A small Spark-X2.5 HF folder (6 layers [s, s, s, f, s, s], hidden 128, vocab 512, window 64)
is converted to an F16 GGUF by llama.cpp's own converter; llama.cpp's logits for 520 token
ids (most of them beyond the window) are compared with our vLLM class's (fp32). The engine's
tests compare that class with an independent torch reference.
"""

import gc

import numpy as np
import pytest
import torch

WINDOW, TOKENS, VOCAB = 64, 520, 512
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. 12345 67.")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """Built as `edge-infer models pull spark-x2.5-*-random` builds the real shapes, smaller: a
    byte-level BPE trained here, padded to the vocab with Spark's chat markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from edge_infer import profiles
    from edge_infer.models.random_weights import build_random
    from edge_infer.models.registry import SPARK_EOS, SPARK_SOS, SPARK_SPECIAL_TOKENS, spark

    root = tmp_path_factory.mktemp("spark-small")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(root / "bpe")
    config = spark(128, 256, 6, 4, 2, head_dim=64, vocab=VOCAB, window=WINDOW,
                   max_positions=2048)
    build_random(config, 0, root / "bpe", root / "hf", special_tokens=SPARK_SPECIAL_TOKENS,
                 bos=SPARK_SOS, eos=SPARK_EOS,
                 chat_template=profiles.load("spark-x2.5-1.7b-random").chat.template,
                 std=0.1, norm_std=0.1)
    return root / "hf"


@pytest.fixture(scope="module")
def gguf_f16(small_model, edge_home, tmp_path_factory):
    from edge_harness.bench.gguf_build import convert

    return convert(small_model, tmp_path_factory.mktemp("gguf") / "spark-small-f16.gguf", "f16")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def llamacpp_logits(gguf_f16, ids):
    import llama_cpp

    # flash attention pinned off, one thread: llama.cpp's numerics are then reproducible
    llm = llama_cpp.Llama(model_path=str(gguf_f16), n_ctx=1024, n_batch=1024, n_ubatch=1024,
                          n_threads=1, logits_all=True, flash_attn=False, verbose=False)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids) - 1], dtype=np.float32))
    finally:
        llm.close()


@pytest.fixture(scope="module")
def vllm_logits(small_model, ids):
    from edge_infer import profiles
    from edge_infer.serve.offline import make_llm
    from edge_infer.serve.resolve import Resolved
    from edge_infer.serve.runtime import vllm_env
    from edge_infer.vllm_ext.logits import prompt_logits

    prof = profiles.load("spark-x2.5-1.7b-random")
    mp = pytest.MonkeyPatch()
    for k, v in vllm_env(prof).items():
        mp.setenv(k, v)
    llm = make_llm(Resolved(small_model, "spark-small", prof), prefix_caching=False,
                   dtype="float32", max_model_len=1024, max_num_batched_tokens=1024)
    try:
        return prompt_logits(llm, ids)
    finally:
        del llm
        gc.collect()
        mp.undo()


def field(reader, key):
    f = reader.fields[key]
    values = [f.parts[i].tolist() for i in f.data]
    if f.types and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode()
    return [v[0] for v in values] if len(values) > 1 else values[0][0]


def test_gguf_carries_the_architecture(gguf_f16):
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_f16))
    assert field(r, "general.architecture") == "spark2_5"
    assert field(r, "spark2_5.attention.sliding_window") == WINDOW
    assert field(r, "spark2_5.attention.sliding_window_pattern") == [1, 1, 1, 0, 1, 1]
    assert field(r, "spark2_5.rope.dimension_count") == 16  # 64 x 0.25, full layers
    assert field(r, "spark2_5.rope.dimension_count_swa") == 64
    assert field(r, "spark2_5.rope.freq_base") == 5e6
    assert field(r, "spark2_5.rope.freq_base_swa") == 1e4
    names = {t.name for t in r.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "token_embd.weight"} <= names
    assert "output.weight" not in names  # tied: llama.cpp reuses the embedding


def test_llamacpp_tokenizes_like_hf(small_model, gguf_f16):
    import llama_cpp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_model)
    chat = tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False,
                                   add_generation_prompt=True)
    llm = llama_cpp.Llama(model_path=str(gguf_f16), vocab_only=True, verbose=False)
    for text in (TEXT, chat):
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert theirs == tok(text, add_special_tokens=False)["input_ids"]


def test_llamacpp_f16_matches_our_vllm_class(llamacpp_logits, vllm_logits):
    assert llamacpp_logits.shape == vllm_logits.shape == (TOKENS - 1, VOCAB)
    same_top = (llamacpp_logits.argmax(-1) == vllm_logits.argmax(-1)).float().mean().item()
    p, q = vllm_logits.log_softmax(-1), llamacpp_logits.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert same_top >= 0.99, same_top
    assert kl.mean().item() <= 1e-3, kl.mean()
    assert kl[WINDOW:].mean().item() <= 1e-3, kl[WINDOW:].mean()  # beyond the window
