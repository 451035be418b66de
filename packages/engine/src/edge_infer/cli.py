"""The one `edge-infer` command.

Subcommands come from the `edge_infer.commands` entry-point group: each entry point is a
function `add_parser(subparsers)` that adds one subcommand and sets `func(args) -> int`.
The engine registers its own commands there too, so installing the harness or the exporter
grows `edge-infer --help` and nothing here changes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from edge_infer import __version__
from edge_infer.errors import EdgeInferError

GROUP = "edge_infer.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-infer",
        description="Fast, honest LLM inference on CPUs and edge devices.",
    )
    parser.add_argument("--version", action="version", version=f"edge-infer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            add_parser = ep.load()
        except Exception as exc:  # a broken optional package must not take the CLI down
            logging.getLogger(__name__).warning("command %r unavailable: %s", ep.name, exc)
            continue
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except EdgeInferError as exc:
        print(f"edge-infer {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"edge-infer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
