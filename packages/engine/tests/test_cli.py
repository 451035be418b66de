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


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(argv):
    """`edge-infer --help` answers in a fraction of a second: torch (seconds to import here)
    stays out of the process until a command needs it."""
    code = ("import sys\nfrom edge_infer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("NO-TORCH"), out.stdout + out.stderr
