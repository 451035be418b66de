"""Finding the Qualcomm QNN SDK, and importing ExecuTorch's Qualcomm backend without it.

`import executorch.backends.qualcomm` downloads the QNN SDK (~GBs, from Qualcomm's site) when
`QNN_SDK_ROOT` is unset (executorch 1.4.1, backends/qualcomm/__init__.py). We never want that:
when the variable is unset we point it at an empty folder of ours before the import. Quantizing
(QnnQuantizer) and simulating need no SDK; lowering to a QNN context binary needs the SDK's
HTP backend library, `lib/x86_64-linux-clang/libQnnHtp.so`, which is not on PyPI.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from edge_infer.api import EdgeInferError, home

HTP_LIB = "lib/x86_64-linux-clang/libQnnHtp.so"
_OURS = "no-qnn-sdk"  # the name of our empty stand-in folder


def placeholder_root() -> Path:
    return home() / _OURS


@dataclass(frozen=True)
class SdkStatus:
    root: Path | None  # QNN_SDK_ROOT as the user set it (None: unset or our placeholder)
    htp_lib: Path | None  # libQnnHtp.so when found

    @property
    def can_lower(self) -> bool:
        return self.htp_lib is not None

    def explain(self) -> str:
        """One line: what the SDK situation allows."""
        if self.can_lower:
            return f"QNN SDK found at {self.root} ({HTP_LIB} present): lowering to QNN is possible"
        if self.root is None:
            where = "QNN_SDK_ROOT is unset"
        else:
            where = f"QNN_SDK_ROOT={self.root} has no {HTP_LIB}"
        return (f"{where}: lowering to a QNN context binary needs the Qualcomm QNN SDK "
                "(Qualcomm AI Engine Direct, not on PyPI); set QNN_SDK_ROOT to its root")


def find_sdk() -> SdkStatus:
    """Where the QNN SDK is, from QNN_SDK_ROOT only; cheap (imports nothing)."""
    value = os.environ.get("QNN_SDK_ROOT")
    if not value or Path(value) == placeholder_root():
        return SdkStatus(None, None)
    root = Path(value).expanduser()
    lib = root / HTP_LIB
    return SdkStatus(root, lib if lib.is_file() else None)


def guard_sdk_download() -> SdkStatus:
    """Make `import executorch.backends.qualcomm` safe: never a download. Idempotent."""
    status = find_sdk()
    if not os.environ.get("QNN_SDK_ROOT"):
        placeholder_root().mkdir(parents=True, exist_ok=True)
        os.environ["QNN_SDK_ROOT"] = str(placeholder_root())
    return status


def import_qualcomm():
    """Import the Qualcomm quantizer, guarded; returns (QnnQuantizer, QuantDtype)."""
    guard_sdk_download()
    import torch

    mkldnn = torch.backends.mkldnn.enabled
    # The package prints "[QNN] Using QNN SDK at <our empty folder>" and warns that the SDK's
    # backend_opinfo is missing: both untrue or irrelevant for quantizing, so kept off the terminal.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    except ImportError as exc:
        raise EdgeInferError(f"executorch's Qualcomm backend failed to import ({exc}); "
                             "reinstall edge-infer-export with its dependencies") from exc
    finally:
        logging.disable(previous)
        # It also turns oneDNN off process-wide on AMD CPUs; our float references and the
        # XNNPACK runs in the same process must not change with import order.
        torch.backends.mkldnn.enabled = mkldnn
    return QnnQuantizer, QuantDtype
