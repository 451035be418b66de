"""The token ids every build of an engine is scored on, chunked as `llama-perplexity` chunks them.

The corpus text is tokenized once, by the engine's runner (`tokenize`, runners.base.Scorer;
llama.cpp's is what `llama-perplexity -f` does: add_special on, special tokens not parsed), and
cut into consecutive chunks of n_ctx ids; when the vocabulary adds BOS, the first id of every
chunk is replaced by BOS. Positions n_ctx/2 .. n_ctx-2 are scored (each predicts the next id),
so every scored position has at least n_ctx/2 tokens of context. Engines are fed these ids
(never text): two engines that tokenize alike (ours uses llama.cpp's) are scored over identical
tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def make_chunks(tokenize: Callable[[str], tuple[list[int], int | None]], corpus: str, n_ctx: int,
                count: int) -> Chunks:
    """`count` chunks of `corpus` with `tokenize(text) -> (ids, bos or None)`."""
    if n_ctx < 8 or n_ctx % 2:
        raise UsageError(f"--ctx {n_ctx}: must be an even number >= 8")
    ids, bos = tokenize(corpus_text(corpus))
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
