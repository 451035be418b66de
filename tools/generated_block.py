"""What the tools that generate a block inside a hand-written page share: the bench records,
a median (min-max) cell, and rewriting or checking the block between two markers."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_records() -> list[dict]:
    """The speed records (kind "bench"; checks such as llama_bench_crosscheck left out)."""
    lines = (ROOT / "docs" / "results" / "bench.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r.get("kind", "bench") == "bench"]


def cell(r: dict) -> str:
    """A record's median with the min-max of its samples."""
    return f"{r['median']:.1f} ({min(r['samples']):.1f}-{max(r['samples']):.1f})"


def rewrite(page: Path, start: str, end: str, body: str, check: bool, stale: str) -> int:
    """Put `body` between the markers of `page`; with `check`, only compare and print `stale`
    (exit status 1) when the committed page differs."""
    text = page.read_text()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{start}\n{body}\n{end}{tail}"
    if check:
        if new != text:
            print(stale)
            return 1
        return 0
    page.write_text(new)
    return 0
