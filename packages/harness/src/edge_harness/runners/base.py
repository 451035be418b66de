"""The protocol every engine adapter implements, and what it is given.

An adapter is one file in this folder that sets `RUNNER = TheClass` (or any class named as
`package.module:Class` on the command line). It declares everything it can do as class
attributes; get_runner checks the declarations against the methods:
- `Runner` (every adapter): `prepare` runs in the planning process: it makes (and caches)
  this engine's weights for a model and quant from the model's HF folder, and says what they
  are (`Build`); `load`, `pp`, `tg`, `close` run in the pinned child (isolation.worker), one
  engine per process. They must not import the engine at module import time: planning imports
  every adapter, and an engine's import can take seconds (vLLM) or set up thread pools.
- `Scorer` (adapters whose `full_precision` is a quant; None: timing only): what
  `edge-infer fidelity` needs: the tokens a text is scored on, full-vocabulary log-probs and
  greedy continuations. Every build is scored against the engine's `full_precision` build.
- `Profiler` (adapters with `profiler = True`): `bench profile`'s per-op split of decode steps.

Semantics are llama-bench's: `pp(n)` is one forward of n random token ids (logits for the last
position only) on an empty cache; `tg(n)` is n single-token decodes starting from an empty
cache. Each returns elapsed seconds of that work only (no tokenization, no sampling loop
beyond what the engine itself does per step, no model load).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ModelRef:
    """A model to benchmark: its HF folder (the one source of weights for every engine)."""

    name: str
    hf_dir: Path
    gguf: Path | None = None  # the published GGUF it came from, if any

    @property
    def config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())

    @property
    def token_range(self) -> int:
        """Random ids are drawn below this: a valid token for the tokenizer and the model."""
        vocab = int(self.config["vocab_size"])
        tok = self.hf_dir / "tokenizer.json"
        if tok.is_file():
            data = json.loads(tok.read_text())
            vocab_ids = data.get("model", {}).get("vocab", {})
            ids = list(vocab_ids.values()) if isinstance(vocab_ids, dict) else []
            ids += [t["id"] for t in data.get("added_tokens", [])]
            if ids:  # random-weight models pad the embedding past the tokenizer's ids
                vocab = min(vocab, max(ids) + 1)
        return vocab


@dataclass(frozen=True)
class Build:
    """One engine's weights of one model at one quant, ready to load."""

    engine: str
    model: str
    quant: str
    path: str  # what the engine loads (HF folder, GGUF file)
    bits_per_weight: float  # stored tensor bits over every parameter of the source model
    weight_bytes_per_token: int  # bytes of weights a decode step reads (roofline)
    token_range: int
    options: dict[str, Any] = field(default_factory=dict)  # per-engine overrides

    @property
    def label(self) -> str:
        """'engine:quant', plus '@k=v,...' per-engine options (as on the command line)."""
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.engine}:{self.quant}" + (f"@{opts}" if opts else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Build:
        return cls(**d)


class Runner(Protocol):
    name: ClassVar[str]
    quants: ClassVar[tuple[str, ...]]  # the builds it offers, as error messages list them
    # the build fidelity scores every other build of this engine against (its unquantized
    # weights), or None: the engine only times pp/tg and fidelity refuses it
    full_precision: ClassVar[str | None]
    profiler: ClassVar[bool]  # has `profile` (see Profiler)

    @classmethod
    def accepts(cls, quant: str) -> bool:
        """Whether `quant` names a build of this engine (more than `quants` may list)."""
        ...

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build: ...

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        """Environment the child needs before the engine is imported."""
        ...

    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        """Load the weights; return facts: version, threads, prefix_caching and settings."""
        ...

    def pp(self, n: int, seed: int) -> float: ...

    def tg(self, n: int, seed: int) -> float: ...

    def close(self) -> None: ...


class Scorer(Runner, Protocol):
    """What fidelity asks of an engine whose `full_precision` is not None."""

    @classmethod
    def tokenize(cls, model: ModelRef, text: str) -> tuple[list[int], int | None]:
        """(ids, BOS id or None) of `text` as this engine is scored on it, as llama-perplexity
        tokenizes (BOS first when the vocabulary adds one); fidelity cuts the ids into chunks
        and puts BOS in place of the first id of each. Runs in the planning process."""
        ...

    def logprobs(self, ids: list[int], first: int) -> Any:
        """float32 torch tensor of log-softmax rows [len(ids) - 1 - first, vocab]: row r is the
        distribution of token first + r + 1, from one forward of `ids` on an empty cache."""
        ...

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n argmax tokens after `ids`, past any end-of-generation token (always n)."""
        ...


class Profiler(Runner, Protocol):
    """What `bench profile` asks of an engine whose `profiler` is True."""

    def profile(self, n: int, seed: int, top: int = 25, batch: int = 1) -> dict[str, Any]:
        """Where decode steps' time goes: tokens, decode_s, wall_s, in_ops_s, ops, ops_total."""
        ...


def members(proto: type) -> list[str]:
    """The attributes and methods `proto` itself declares (not those it inherits)."""
    names = [*getattr(proto, "__annotations__", {}), *vars(proto)]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def missing(cls: type) -> list[str]:
    """What `cls` lacks of the protocols its declarations promise (empty: a complete adapter)."""
    protos = [Runner]
    if getattr(cls, "full_precision", None) is not None:
        protos.append(Scorer)
    if getattr(cls, "profiler", False):
        protos.append(Profiler)
    return [f"{p.__name__}.{m}" for p in protos for m in members(p) if not hasattr(cls, m)]


def random_ids(n: int, token_range: int, seed: int, first: int | None = None) -> list[int]:
    """n ids uniform in [0, token_range), the first replaced by `first` (BOS) when given."""
    rng = random.Random(seed)
    ids = [rng.randrange(token_range) for _ in range(n)]
    if first is not None and ids:
        ids[0] = first
    return ids
