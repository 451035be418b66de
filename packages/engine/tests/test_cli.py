import ast
import subprocess
import sys

import pytest

from conftest import run_cli


def test_help_lists_installed_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "models" in out.stdout


def test_every_subcommand_has_help():
    for cmd in (["models"], ["models", "list"], ["models", "pull"], ["models", "verify"]):
        out = run_cli(*cmd, "--help")
        assert out.returncode == 0, out.stderr
        assert "usage: edge-infer" in out.stdout


def test_every_flag_has_help_text():
    """`--help` explains every option and argument of every installed subcommand."""
    import argparse

    from edge_infer.cli import build_parser

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif not action.help and action.dest != "help":
                missing.append(" ".join([*path, *(action.option_strings or [action.dest])]))

    walk(build_parser(), ["edge-infer"])
    assert not missing, f"flags without help text: {missing}"


def test_unknown_profile_is_a_one_line_error():
    """`serve --profile typo` names the shipped profiles instead of silently serving defaults."""
    out = run_cli("serve", "--profile", "no-such-profile", "--dry-run")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "no profile 'no-such-profile'; shipped:" in out.stderr and "smollm2-135m" in out.stderr


def test_bad_usage_exits_2():
    out = run_cli("no-such-command")
    assert out.returncode == 2
    out = run_cli("models", "pull", "no-such-model")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_missing_model_is_one_line_failure(tmp_path):
    out = run_cli("models", "path", "smollm2-135m", env={"EDGE_INFER_HOME": str(tmp_path)})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "not pulled" in lines[0] and "edge-infer models pull smollm2-135m" in lines[0]


def test_list_json(tmp_path):
    import json

    out = run_cli("models", "list", "--json", env={"EDGE_INFER_HOME": str(tmp_path)})
    assert out.returncode == 0
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen3-0.6b-random"} <= set(rows)
    assert not any(r["pulled"] for r in rows.values())


HEAVY = ("torch", "vllm", "transformers")


def help_imports(argv: list[str], prelude: str = "") -> tuple[str, list[str]]:
    """`edge-infer ARGV` in a fresh interpreter: its output, and which of HEAVY it imported."""
    code = (f"import sys\n{prelude}\nfrom edge_infer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "HEAVY" in out.stdout, out.stdout + out.stderr
    text, _, heavy = out.stdout.rpartition("HEAVY ")
    return text, ast.literal_eval(heavy)


def installed_commands() -> list[str]:
    from edge_infer.cli import build_parser

    return sorted(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in installed_commands())],
                         ids=" ".join)
def test_help_does_not_import_torch(argv):
    """`edge-infer --help` and each installed subcommand's answer in a fraction of a second:
    torch, vLLM and transformers (seconds to import here) stay out of the process until a
    command runs."""
    text, heavy = help_imports(argv)
    assert "usage: edge-infer" in text, text  # the help really printed
    assert heavy == [], f"`edge-infer {' '.join(argv)}` imported {heavy}"


def test_the_import_check_sees_torch():
    """The check above can fail: the same probe in a process that imported torch says so."""
    text, heavy = help_imports(["--help"], prelude="import torch")
    assert "usage: edge-infer" in text and heavy == ["torch"]
