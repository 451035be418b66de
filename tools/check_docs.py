#!/usr/bin/env python3
"""Docs gate (run by `nox -s docs-check`, part of `nox -s tests`):

1. The pages generated from docs/results/*.jsonl are not stale: each is regenerated from the
   committed records into a scratch folder and must equal the committed markdown (plots are
   regenerated too but not compared byte for byte: PNG encoders differ between builds).
2. Every relative link in README.md and docs/**/*.md resolves to a file in the tree.

Exit status 1 with a list of what is stale or broken; `nox -s docs` regenerates the pages.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def regenerate(scratch: Path) -> dict[Path, Path]:
    """Committed page -> the page regenerated from the committed records."""
    for jsonl in RESULTS.glob("*.jsonl"):
        shutil.copy(jsonl, scratch / jsonl.name)
    py = [sys.executable]
    pairs = {}
    if (scratch / "bench.jsonl").is_file():
        run([*py, "-m", "edge_infer", "bench", "report", "--results", str(scratch / "bench.jsonl"),
             "--out", str(scratch)])
        pairs[RESULTS / "report.md"] = scratch / "report.md"
        if (scratch / "profile.jsonl").is_file():
            pairs[RESULTS / "profile.md"] = scratch / "profile.md"
        if (scratch / "serve.jsonl").is_file():
            pairs[RESULTS / "serve.md"] = scratch / "serve.md"
    if (scratch / "fidelity.jsonl").is_file():
        run([*py, "-m", "edge_infer", "fidelity", "report", "--results",
             str(scratch / "fidelity.jsonl"), "--out", str(scratch / "fidelity.md")])
        pairs[RESULTS / "fidelity.md"] = scratch / "fidelity.md"
    if (scratch / "export.jsonl").is_file():
        run([*py, "-m", "edge_export.records", str(scratch / "export.jsonl"),
             str(scratch / "export.md"), "--command", "nox -s export"])
        pairs[RESULTS / "export.md"] = scratch / "export.md"
    if (scratch / "tasks.jsonl").is_file():
        run([*py, "-m", "edge_infer", "eval", "report", "--results", str(scratch / "tasks.jsonl"),
             "--out", str(scratch / "tasks.md")])
        pairs[ROOT / "docs" / "analysis" / "tasks.md"] = scratch / "tasks.md"
    run([*py, "-m", "edge_harness.report.comparison", str(scratch), str(scratch / "comparison.md")])
    pairs[ROOT / "docs" / "engines" / "comparison.md"] = scratch / "comparison.md"
    return pairs


def run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"docs-check: `{' '.join(cmd)}` failed:\n{res.stderr[-2000:]}")


def broken_links() -> list[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no links in code blocks
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # URLs and in-page anchors
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                bad.append(f"{page.relative_to(ROOT)}: link to {target} does not resolve")
    return bad


def main() -> int:
    problems = broken_links()
    with tempfile.TemporaryDirectory() as tmp:
        for committed, fresh in regenerate(Path(tmp)).items():
            if not committed.is_file():
                problems.append(f"{committed.relative_to(ROOT)} is missing (run `nox -s docs`)")
            elif committed.read_text() != fresh.read_text():
                problems.append(f"{committed.relative_to(ROOT)} is stale: it differs from what the "
                                "committed records give (run `nox -s docs` and commit)")
    # generated blocks inside hand-written pages
    for tool in ("readme_headline.py", "decode_ablation.py", "kernel_table.py", "scale_table.py"):
        check = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--check"],
                               capture_output=True, text=True)
        if check.returncode:
            problems.append(check.stdout.strip() or check.stderr.strip())
    for p in problems:
        print(f"docs-check: {p}", file=sys.stderr)
    if not problems:
        print("docs-check: generated pages match the records; all relative links resolve")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
