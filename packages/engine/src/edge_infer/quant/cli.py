"""`edge-infer quantize MODEL_DIR OUT_DIR --scheme w4a16 --group 128 ...`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge_infer.errors import UsageError
from edge_infer.models.registry import REGISTRY
from edge_infer.quant.config import GROUPS, SCHEMES, W4Config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a 4-bit edge_w4 checkpoint from a bf16 HF folder")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="HF folder, or a name from `models list`")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    p.add_argument("--scheme", choices=SCHEMES, default="w4a16")
    p.add_argument("--group", type=int, choices=GROUPS, default=128)
    p.add_argument("--zero-point", action="store_true", help="asymmetric: uint4 codes + zero")
    p.add_argument("--scale-dtype", choices=("fp16", "bf16"), default="bf16")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="also 4-bit the LM head and embedding table (tied or not)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from edge_infer.quant.checkpoint import quantize_checkpoint

    src = args.model_dir
    if src in REGISTRY:
        from edge_infer.models.store import model_path

        src = model_path(src).hf_dir
    src = Path(src)
    if not src.is_dir():
        raise UsageError(f"MODEL_DIR {src} is not a folder")
    cfg = W4Config(scheme=args.scheme, group_size=args.group, zero_point=args.zero_point,
                   scale_dtype=args.scale_dtype, quantize_lm_head=args.quantize_lm_head)
    try:
        report = quantize_checkpoint(src, args.out_dir, cfg, overwrite=args.overwrite)
    except ValueError as exc:  # e.g. a group that does not divide a layer's in_features
        raise UsageError(str(exc)) from None
    print(json.dumps(report.as_dict(), indent=2))
    return 0
