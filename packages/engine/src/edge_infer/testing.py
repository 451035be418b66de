"""Test helpers the three packages share, so that each has one copy: a private EDGE_INFER_HOME
for the session, the default model pulled into it, a tiny byte-level BPE tokenizer and the small
Spark-X2.5 folder built from it.

A conftest loads the fixtures with `pytest_plugins = ["edge_infer.testing"]`; the builders are
plain functions. This module imports pytest, so nothing in edge_infer itself imports it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_infer.models.registry import spark
from edge_infer.results import missing_provenance

# What the tiny BPE is trained on (50 times over): about 400 tokens come out of it.
BPE_TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. 12345 67.")

# Spark-X2.5 made small: 6 layers [s, s, s, f, s, s], hidden 128, vocab 512 and a 64-token
# window, so a 520-token prompt puts most positions beyond the window.
SMALL_SPARK = spark(128, 256, 6, 4, 2, head_dim=64, vocab=512, window=64, max_positions=2048)


def provenance_gaps(record: dict) -> list[str]:
    """`missing_provenance(record)`, less the dirty flag where this machine has no git (the
    engine image ships none): a record written there cannot say whether its tree was clean,
    and the append would refuse to publish it, which is what the flag is for."""
    gaps = missing_provenance(record)
    return gaps if shutil.which("git") else [g for g in gaps if g != "git_dirty"]


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set these environment variables for the block, then put back what was there before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def edge_home(tmp_path_factory) -> Iterator[Path]:
    """One private EDGE_INFER_HOME for the test session: tests never touch the user's cache."""
    home = tmp_path_factory.mktemp("edge-home")
    with environ(EDGE_INFER_HOME=str(home)):
        yield home


@pytest.fixture(scope="session")
def smollm2(edge_home):
    """The embedded default model, pulled once per test session through the real CLI path."""
    from edge_infer.models.pull import pull

    return pull("smollm2-135m")


def tiny_bpe_tokenizer(out: Path | None = None):
    """A byte-level BPE (~400 tokens) trained on BPE_TEXT, `<|endoftext|>` its bos and eos, as a
    transformers fast tokenizer; saved into `out` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([BPE_TEXT] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")
    if out is not None:
        fast.save_pretrained(out)
    return fast


def build_small_spark(root: Path) -> Path:
    """SMALL_SPARK as an HF folder, built like `models pull spark-x2.5-*-random` builds the real
    shapes: the tiny BPE (in root/bpe) padded to the vocab with Spark's chat markers, random
    weights with std 0.1 and norms 1 + N(0, 0.1) (so a norm applied as 1 + w, or skipped,
    shows). Returns root/hf."""
    from edge_infer import profiles
    from edge_infer.models.random_weights import build_random
    from edge_infer.models.registry import SPARK_EOS, SPARK_SOS, SPARK_SPECIAL_TOKENS

    tiny_bpe_tokenizer(root / "bpe")
    template = profiles.load("spark-x2.5-1.7b-random").chat.template
    build_random(SMALL_SPARK, 0, root / "bpe", root / "hf", special_tokens=SPARK_SPECIAL_TOKENS,
                 bos=SPARK_SOS, eos=SPARK_EOS, chat_template=template, std=0.1, norm_std=0.1)
    return root / "hf"
