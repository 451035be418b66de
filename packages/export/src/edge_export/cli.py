"""`edge-infer export MODEL --target T --out DIR` (registered in the edge_infer.commands group).

Imports here stay light: torch, ExecuTorch and qai-hub load only when a command runs, so a
refusal (no credentials, no SDK) comes back in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edge_export.targets import GROUP_SIZE, TARGETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to ExecuTorch/XNNPACK, QNN or AI Hub, scored by SQNR",
        description="Export MODEL (a HF folder or a name from `edge-infer models list`) to one "
        "target and score its logits by SQNR against the float eager model. Targets: "
        + "; ".join(f"{name}: {t.help}" for name, t in TARGETS.items()),
    )
    p.add_argument("model", metavar="MODEL", help="folder or model name (see `models list`)")
    p.add_argument("--target", choices=sorted(TARGETS), metavar="T",
                   help=", ".join(TARGETS) + " (required unless --ablate)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder the export is written to (required unless --ablate)")
    p.add_argument("--ablate", action="store_true",
                   help="no export: score the 8da4w variants (head bits, group, weight-only, "
                   "sink prefix, SmoothQuant) in eager, one record each (edge_export.ablate)")
    p.add_argument("--variants", default=None, metavar="NAMES",
                   help="--ablate: variants separated by ';' (default: all)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="--ablate: write to docs/results even from a dirty git tree")
    p.add_argument("--unit", choices=("decoder", "block"), default="decoder",
                   help="the whole decoder, or its first transformer block (the quick unit)")
    p.add_argument("--calibration", type=int, default=16, metavar="N",
                   help="calibration windows (QNN, AI Hub; xnnpack-8da4w: for its grid-keeping "
                   "activation scales); 0 = uncalibrated (default 16)")
    p.add_argument("--corpus", dest="calibration_corpus", default="lee",
                   choices=("lee", "shakespeare", "builtin"),
                   help="calibration corpus; scoring uses the other one (default lee)")
    p.add_argument("--eval-sequences", type=int, default=4, metavar="E",
                   help="windows of CONTEXT tokens scored (default 4)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per graph call (default 32)")
    p.add_argument("--context", type=int, default=128, help="static KV window (default 128)")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE,
                   help=f"8da4w weight group (default {GROUP_SIZE})")
    p.add_argument("--soc", default="SM8650", help="QNN lowering SoC (default SM8650)")
    p.add_argument("--require-sdk", action="store_true",
                   help="qnn-*: fail at once unless the QNN SDK (libQnnHtp.so) is found")
    p.add_argument("--device", default=None,
                   help='aihub: device name (default "Samsung Galaxy S24 (Family)")')
    p.add_argument("--hub-options", default=None,
                   help="aihub: compile options (default: --target_runtime qnn_context_binary "
                   "--quantize_full_type w8a16)")
    p.add_argument("--no-sink-prefix", dest="sink_prefix", action="store_false",
                   help="feed the first token through the graph too, instead of giving every "
                   "sequence the fp32 keys/values of BOS as its initial cache")
    p.add_argument("--record", type=Path, default=None, metavar="JSONL",
                   help="also append the record to this JSONL (e.g. docs/results/export.jsonl)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from edge_export.targets import preflight
    from edge_infer.api import UsageError

    logging.getLogger("edge_export").setLevel(logging.INFO)
    if args.ablate:
        return cmd_ablate(args)
    if args.target is None or args.out is None:
        raise UsageError("export needs --target T and --out DIR (or --ablate, which needs "
                         "neither)")
    client = preflight(args.target, unit=args.unit, calibration=args.calibration,
                       eval_sequences=args.eval_sequences, require_sdk=args.require_sdk)
    from edge_export.decoder import StaticShape
    from edge_export.pipeline import Request, run

    req = Request(
        model=args.model, target=args.target, out=args.out, unit=args.unit,
        calibration=args.calibration, calibration_corpus=args.calibration_corpus,
        eval_sequences=args.eval_sequences, shape=StaticShape(args.chunk, args.context),
        group_size=args.group_size, soc=args.soc, require_sdk=args.require_sdk,
        device=args.device, hub_options=args.hub_options, record=args.record,
        sink_prefix=args.sink_prefix,
    )
    record = run(req, client)
    cal = record.get("calibration")
    cal_text = "" if not cal else f", calibration {cal['corpus']} x{cal['samples']}"
    print(f"{record['target']} ({record['unit']}{cal_text}): SQNR {record['sqnr_db']:.1f} dB "
          f"({record['measured']}), {record.get('artifact')} "
          f"{(record.get('size_bytes') or 0) / 2**20:.1f} MiB, export {record['export_s']:.0f} s")
    if record.get("needs"):
        print(f"to go further: {record['needs']}")
    print(f"record: {args.out / 'record.json'}", file=sys.stderr)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from edge_export.ablate import ablate
    from edge_export.decoder import StaticShape
    from edge_infer.api import require_clean

    require_clean(args.record, args.allow_dirty)  # a published figure names its commit
    names = [n.strip() for n in args.variants.split(";")] if args.variants else None
    rows = ablate(args.model, names, eval_sequences=args.eval_sequences,
                  calibration=args.calibration or 16, calibration_corpus=args.calibration_corpus,
                  shape=StaticShape(args.chunk, args.context), record_path=args.record)
    width = max(len(r["variant"]) for r in rows)
    print(f"{'variant':{width}}  SQNR dB  same top %  KL")
    for r in rows:
        print(f"{r['variant']:{width}}  {r['sqnr_db']:7.2f}  {r['same_top_pct']:10.2f}  "
              f"{r['kl_mean']:.4f}")
    return 0
