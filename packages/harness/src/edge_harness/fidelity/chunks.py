"""The token ids both engines are scored on, chunked as `llama-perplexity` chunks them.

The corpus text is tokenized once, by llama.cpp's tokenizer of the model's GGUF (what
`llama-perplexity -f` does: add_special on, special tokens not parsed), and cut into consecutive
chunks of n_ctx ids; when the vocabulary adds BOS, the first id of every chunk is replaced by
BOS. Positions n_ctx/2 .. n_ctx-2 are scored (each predicts the next id), so every scored
position has at least n_ctx/2 tokens of context. Our engine is fed these same ids (never text),
so its numbers and llama.cpp's are over identical tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_infer.api import UsageError, corpus_text


@dataclass(frozen=True)
class Chunks:
    corpus: str
    n_ctx: int
    ids: list[list[int]]  # each n_ctx long, BOS already in place
    total_tokens: int  # of the whole tokenized corpus

    @property
    def first(self) -> int:
        """First scored position (its logits predict id first + 1)."""
        return self.n_ctx // 2

    @property
    def rows(self) -> int:
        return self.n_ctx - 1 - self.first


def tokenize(gguf: Path, text: str) -> tuple[list[int], int | None]:
    """(ids, bos or None) with llama.cpp's tokenizer of `gguf`, as llama-perplexity does."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        bos = llama_cpp.llama_vocab_bos(vocab) if add_bos else None
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    finally:
        llm.close()
    return ids, bos


def make_chunks(gguf: Path, corpus: str, n_ctx: int, count: int) -> Chunks:
    if n_ctx < 8 or n_ctx % 2:
        raise UsageError(f"--ctx {n_ctx}: must be an even number >= 8")
    ids, bos = tokenize(gguf, corpus_text(corpus))
    available = len(ids) // n_ctx
    if count > available:
        raise UsageError(f"corpus {corpus!r} has {len(ids)} tokens: {available} chunks of "
                         f"{n_ctx}, fewer than the {count} asked for")
    chunks = []
    for i in range(count):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        chunks.append(chunk)
    return Chunks(corpus, n_ctx, chunks, len(ids))
