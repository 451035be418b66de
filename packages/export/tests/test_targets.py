"""Each target is one entry of targets.TARGETS: the CLI and the pipeline read it from there."""

import ast
import inspect
import subprocess
import sys
import tomllib
from importlib import resources

from edge_export.targets import TARGETS
from edge_infer.cli import build_parser


def test_every_target_names_an_exporter_with_the_pipelines_signature():
    for name, target in TARGETS.items():
        export = target.exporter()
        assert callable(export), name
        params = list(inspect.signature(export).parameters)
        assert params == ["job", "target", "eval_windows", "ref", "record"], (name, params)


def test_export_help_is_the_targets_own(capsys):
    parser = build_parser()
    export = parser._subparsers._group_actions[0].choices["export"]
    text = export.format_help()
    for name, target in TARGETS.items():
        assert name in text
        # argparse rewraps the description: compare words, not lines
        assert " ".join(target.help.split()) in " ".join(text.split()), name
    target_flag = next(a for a in export._actions if a.dest == "target")
    assert sorted(target_flag.choices) == sorted(TARGETS)


def test_every_planned_export_run_is_a_command_line_the_cli_accepts():
    """runs.toml (shipped in the package, read by `nox -s export`) names known targets with
    flags `edge-infer export` takes."""
    grid = tomllib.loads((resources.files("edge_export") / "runs.toml").read_text())
    assert grid["runs"]
    for target, *extra in grid["runs"]:
        assert target in TARGETS
        args = build_parser().parse_args(["export", grid["model"], "--target", target, *extra,
                                          "--out", "o"])
        assert args.target == target


def test_export_help_imports_nothing_heavy():
    """The targets' table is read for --help: it must not pull in torch or the toolchains."""
    code = ("import sys\nfrom edge_infer.cli import main\n"
            "try:\n    main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'executorch', 'qai_hub', 'transformers') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    text, _, heavy = out.stdout.rpartition("HEAVY ")
    assert out.returncode == 0 and "usage: edge-infer export" in text, out.stdout + out.stderr
    assert ast.literal_eval(heavy) == [], f"`edge-infer export --help` imported {heavy}"
