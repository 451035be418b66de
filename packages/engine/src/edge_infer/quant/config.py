"""Our 4-bit schemes as data: one config object drives quantize, save, load and report.

It round-trips through a checkpoint's `config.json` as `quantization_config`, with
`quant_method: "edge_w4"`, so vLLM (with our plugin installed) loads the folder with no flags.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

QUANT_METHOD = "edge_w4"
# The one list of our schemes and group sizes: the CLI's choices, the kernels' `schemes`, the
# profiles' [quant] table and the harness's build names all read these.
SCHEMES = ("w4a16", "w4a8")  # same stored codes; w4a8 also rounds activations to int8
GROUPS = (32, 64, 128)
SCALE_DTYPE_NAMES = ("fp16", "bf16")  # their torch dtypes: quant.primitives.SCALE_DTYPES


@dataclass(frozen=True)
class W4Config:
    """One 4-bit build. Its field defaults are the defaults everywhere: `edge-infer quantize`'s
    flags and a profile's [quant] table read them from here."""

    scheme: str = "w4a16"
    group_size: int = 128
    zero_point: bool = False
    scale_dtype: str = "bf16"
    quantize_lm_head: bool = False
    # Linear layers kept in bf16 (prefixes of module names).
    modules_to_not_convert: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme {self.scheme!r} unknown; choose one of {SCHEMES}")
        if self.group_size not in GROUPS:
            raise ValueError(f"group size {self.group_size} unsupported; choose one of {GROUPS}")
        if self.scale_dtype not in SCALE_DTYPE_NAMES:
            raise ValueError(f"scale dtype {self.scale_dtype!r}: choose {' or '.join(SCALE_DTYPE_NAMES)}")

    def bits_per_weight(self, n: int, k: int) -> float:
        """Storage bits per weight of one [n, k] linear: codes + scales (+ zero points)."""
        groups = n * (k // self.group_size)
        # zero points are stored one per byte (uint8), so they cost 8 bits per group
        bits = 4 * n * k + 16 * groups + (8 * groups if self.zero_point else 0)
        return bits / (n * k)

    def to_hf(self) -> dict[str, Any]:
        d = asdict(self)
        d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return {"quant_method": QUANT_METHOD, "bits": 4, **d}

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> W4Config:
        if d.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"not an {QUANT_METHOD} checkpoint: quant_method={d.get('quant_method')}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known - {"quant_method", "bits"}
        if unknown:
            raise ValueError(f"unknown {QUANT_METHOD} quantization_config keys: {sorted(unknown)}")
        kw = {k: v for k, v in d.items() if k in known}
        kw["modules_to_not_convert"] = tuple(kw.get("modules_to_not_convert", ()))
        return cls(**kw)
