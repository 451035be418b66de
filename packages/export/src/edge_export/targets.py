"""The export targets, and the checks that refuse a target before any heavy work.

Imports nothing heavy (no torch, no ExecuTorch, no qai_hub until a client is made), so a
missing credential or SDK is reported in well under a second.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from edge_infer.api import EdgeInferError, UsageError

log = logging.getLogger("edge_export")
# 8da4w's weights per scale (torchao PerGroup) unless --group-size says otherwise.
GROUP_SIZE = 32


@dataclass(frozen=True)
class Target:
    backend: str  # xnnpack | qnn | aihub
    scheme: str
    help: str  # one line of `edge-infer export --help`
    # "module:function" that quantizes, lowers and scores one job for this target; imported only
    # when the target runs (it pulls in torch and the backend's toolchain)
    export: str

    def exporter(self):
        module, _, name = self.export.partition(":")
        return getattr(importlib.import_module(module), name)


_XNNPACK = "edge_export.pipeline:export_xnnpack"
_QNN = "edge_export.pipeline:export_qnn"
_AIHUB = "edge_export.pipeline:export_aihub"
# Adding a target is one entry here: the CLI's choices and help, and the pipeline, read it.
TARGETS = {
    "xnnpack-fp32": Target("xnnpack", "fp32", "ExecuTorch .pte, XNNPACK, fp32", _XNNPACK),
    "xnnpack-8da4w": Target("xnnpack", "8da4w", "ExecuTorch .pte, XNNPACK, int8 dynamic "
                            "activations x int4 grouped weights", _XNNPACK),
    "xnnpack-8da8w": Target("xnnpack", "8da8w", "ExecuTorch .pte, XNNPACK, int8 dynamic "
                            "activations x int8 weights", _XNNPACK),
    "qnn-w8a16": Target("qnn", "w8a16", "QnnQuantizer 8-bit weights / 16-bit activations "
                        "(simulated; lowered with SDK)", _QNN),
    "qnn-w8a8": Target("qnn", "w8a8", "QnnQuantizer 8-bit weights / 8-bit activations", _QNN),
    "qnn-w4a16": Target("qnn", "w4a16", "QnnQuantizer 4-bit weights / 16-bit activations", _QNN),
    "aihub": Target("aihub", "hub", "compile + inference (profile) jobs on a device through "
                    "Qualcomm AI Hub", _AIHUB),
}
# Recorded next to the result, never asserted (issue 8): (target, calibrated) -> dB.
SQNR_TARGETS = {("xnnpack-fp32", False): 100.0, ("qnn-w8a16", True): 30.0}


def preflight(target_name: str, *, unit: str = "decoder", calibration: int = 0,
              eval_sequences: int = 1, require_sdk: bool = False):
    """Refuse at once what cannot work; returns the AI Hub client for the aihub target."""
    if target_name not in TARGETS:
        raise UsageError(f"unknown target {target_name!r}; known: {', '.join(TARGETS)}")
    if calibration < 0 or eval_sequences < 1:
        raise UsageError("--calibration must be >= 0 and --eval-sequences >= 1")
    if unit not in ("decoder", "block"):
        raise UsageError(f"unknown unit {unit!r}; use decoder or block")
    target = TARGETS[target_name]
    if target.backend == "qnn":
        from edge_export.qnn.sdk import find_sdk

        sdk = find_sdk()
        if require_sdk and not sdk.can_lower:
            raise EdgeInferError(f"{target_name}: --require-sdk given but {sdk.explain()}")
        log.info("%s", sdk.explain())
    if target.backend == "aihub":
        if unit != "decoder":
            raise UsageError("the aihub target exports the decoder (--unit decoder)")
        from edge_export.aihub.client import connect

        return connect()
    return None
