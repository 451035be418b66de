"""`edge-infer quantize MODEL_DIR OUT_DIR --scheme w4a16 --group 128 ...`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge_infer.errors import UsageError
from edge_infer.models.registry import REGISTRY
from edge_infer.quant.config import GROUPS, SCALE_DTYPE_NAMES, SCHEMES, W4Config

DEFAULT = W4Config()  # the flags' defaults are the config's


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a 4-bit edge_w4 checkpoint from a bf16 HF folder")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="HF folder, or a name from `models list`")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder the 4-bit checkpoint is written to")
    p.add_argument("--scheme", choices=SCHEMES, default=DEFAULT.scheme,
                   help="w4a16: 16-bit activations; w4a8: int8 activations per token and group "
                   f"(default {DEFAULT.scheme})")
    p.add_argument("--group", type=int, choices=GROUPS, default=DEFAULT.group_size,
                   help=f"weights per scale (default {DEFAULT.group_size})")
    p.add_argument("--zero-point", action="store_true", help="asymmetric: uint4 codes + zero")
    p.add_argument("--scale-dtype", choices=SCALE_DTYPE_NAMES, default=DEFAULT.scale_dtype,
                   help=f"dtype of the stored scales (default {DEFAULT.scale_dtype})")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="also 4-bit the LM head and embedding table (tied or not)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is a checkpoint quantize wrote (it holds "
                   "edge_infer_quant.json); any other file or folder is refused")
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


def add_capture(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="per-layer activation statistics over a corpus "
                       "(safetensors), for calibration")
    p.add_argument("model", metavar="MODEL", help="HF folder, or a name from `models list`")
    p.add_argument("--corpus", default="lee", help="lee | shakespeare | builtin (default lee)")
    p.add_argument("--windows", type=int, default=8, help="token windows (default 8)")
    p.add_argument("--length", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    p.set_defaults(func=cmd_capture)


def cmd_capture(args: argparse.Namespace) -> int:
    from edge_infer.quant.capture import capture

    if args.windows < 1 or args.length < 2:
        raise UsageError("--windows must be >= 1 and --length >= 2")
    src = args.model
    if src in REGISTRY:
        from edge_infer.models.store import model_path

        src = model_path(src).hf_dir
    src = Path(src)
    if not (src / "config.json").is_file():
        raise UsageError(f"MODEL {src}: not a HF folder (no config.json) nor a registry name")
    print(json.dumps(capture(src, args.corpus, args.windows, args.length, args.out), indent=2))
    return 0
