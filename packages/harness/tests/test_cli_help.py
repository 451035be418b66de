"""The harness's subcommands keep `edge-infer --help` fast: their modules import torch, vLLM and
transformers only when a command runs."""

import ast
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "run", "--help"],
                                  ["bench", "serve", "--help"],
                                  ["fidelity", "--help"], ["fidelity", "run", "--help"]],
                         ids=" ".join)
def test_help_imports_nothing_heavy(argv):
    code = ("import sys\nfrom edge_infer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    text, _, heavy = out.stdout.rpartition("HEAVY ")
    assert out.returncode == 0 and f"usage: edge-infer {argv[0]}" in text, out.stdout + out.stderr
    assert ast.literal_eval(heavy) == [], f"`edge-infer {' '.join(argv)}` imported {heavy}"
