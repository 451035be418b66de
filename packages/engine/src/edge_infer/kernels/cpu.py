"""What this CPU can run, read once from /proc/cpuinfo (Linux) with torch's AMX probe."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_id() -> str:
    """Vendor, family, model and stepping from /proc/cpuinfo, e.g. "GenuineIntel 6/207/2": a
    hypervisor often hides the marketing name ("Intel(R) Xeon(R) Processor", "AMD EPYC"), but
    these numbers still say which generation ran; "" where not exposed."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        return ""
    parts = [fields.get(k, "") for k in ("cpu family", "model", "stepping")]
    if not all(parts):
        return ""
    return f"{fields.get('vendor_id', '')} {'/'.join(parts)}".strip()


def isa_level() -> str:
    """The best x86 vector level present: amx > avx512 > avx2 > baseline."""
    flags = cpu_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"


ACT_DTYPES = ("bfloat16", "float32")


def activation_dtype(choice: str = "auto") -> str:
    """The activation dtype vLLM runs the model in: `choice`, or for "auto" bf16 where the CPU
    computes in bf16 (AVX512-BF16 or AMX-BF16) and fp32 where bf16 would be emulated (AVX2,
    AVX-512 without BF16): there every bf16 op converts to fp32 and back."""
    if choice != "auto":
        if choice not in ACT_DTYPES:
            raise ValueError(f"activation dtype {choice!r}: choose auto or one of {ACT_DTYPES}")
        return choice
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32"


def fingerprint() -> dict:
    flags = cpu_flags()
    shown = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {"cpu_model": cpu_model(), "cpu_id": cpu_id(), "isa": isa_level(), "cpu_flags": shown}
