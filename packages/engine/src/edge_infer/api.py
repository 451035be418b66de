"""The engine's public surface: the one edge_infer module other packages (edge_harness,
edge_export) may import. Everything else under edge_infer is private and may change with the
engine; a harness test parses both packages and fails on any other edge_infer import.

Importing this module is cheap: no torch, no vLLM. The names in `_LAZY` (kernels, the
quantizer's primitives, the vLLM extensions, the corpora) import their module on first use,
so a planning process or `--help` never pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from edge_infer import __version__
from edge_infer.errors import EdgeInferError, UsageError
from edge_infer.guard import REMEASURE, Guard, GuardRefused, Reading, Sample, Verdict, tick_slack
from edge_infer.home import home
from edge_infer.kernels.cpu import activation_dtype, fingerprint
from edge_infer.models.pull import pull
from edge_infer.models.registry import DEFAULT_MODEL, REGISTRY
from edge_infer.models.store import PulledModel, is_pulled, model_path
from edge_infer.prompts import GREEDY_PROMPTS, first_divergence
from edge_infer.quant.builds import cached_checkpoint, checkpoint_dir, default_config
from edge_infer.quant.config import GROUPS, SCHEMES, W4Config
from edge_infer.results import (
    PROVENANCE,
    append,
    command_line,
    context,
    git_state,
    latest,
    missing_provenance,
    read,
    require_clean,
    utc_now,
    versions,
)
from edge_infer.serve import process as serve_process  # `edge-infer serve` as a child
from edge_infer.serve.process import ServeFailed, free_port
from edge_infer.serve.process import start as serve_start
from edge_infer.serve.process import stop as serve_stop
from edge_infer.serve.runtime import vllm_env
from edge_infer.topology import (
    choose_cores,
    largest_cache_bytes,
    parse_cpu_list,
    physical_cores,
    siblings,
)

if TYPE_CHECKING:
    from edge_infer.corpus import OTHER as OTHER_CORPUS
    from edge_infer.corpus import corpus_text, token_windows
    from edge_infer.kernels.w4a16 import KERNELS as W4_KERNELS
    from edge_infer.kernels.w4a16 import select as select_w4_kernel
    from edge_infer.quant.primitives import quantize_w4
    from edge_infer.vllm_ext.fused import enabled as fused_decode_enabled
    from edge_infer.vllm_ext.fused import unsupported_reason as fused_decode_unsupported
    from edge_infer.vllm_ext.logits import prompt_logits

# name here -> (module, name there): each of these modules imports torch
_LAZY = {
    # corpora: text, token windows, and the corpus that calibrates a model scored on another
    "corpus_text": ("edge_infer.corpus", "corpus_text"),
    "token_windows": ("edge_infer.corpus", "token_windows"),
    "OTHER_CORPUS": ("edge_infer.corpus", "OTHER"),
    # 4-bit kernels by name (each says available(), schemes, prepack, forward) and the
    # group quantizer they take weights from
    "W4_KERNELS": ("edge_infer.kernels.w4a16", "KERNELS"),
    "select_w4_kernel": ("edge_infer.kernels.w4a16", "select"),  # the one the engine runs
    "quantize_w4": ("edge_infer.quant.primitives", "quantize_w4"),
    # vLLM: prompt logits of a loaded LLM, and whether decode runs our fused layer ops
    "prompt_logits": ("edge_infer.vllm_ext.logits", "prompt_logits"),
    "fused_decode_enabled": ("edge_infer.vllm_ext.fused", "enabled"),
    "fused_decode_unsupported": ("edge_infer.vllm_ext.fused", "unsupported_reason"),
}

__all__ = [
    "DEFAULT_MODEL", "DOT_PEAK_KINDS", "EdgeInferError", "GREEDY_PROMPTS", "GROUPS", "Guard",
    "GuardRefused", "OTHER_CORPUS", "PROVENANCE", "PulledModel", "REGISTRY", "REMEASURE",
    "Reading", "SCHEMES", "Sample", "ServeFailed", "UsageError", "Verdict", "W4Config",
    "W4_KERNELS", "__version__", "activation_dtype", "append", "cached_checkpoint",
    "checkpoint_dir", "choose_cores", "command_line", "context", "corpus_text", "default_config",
    "dot_peak", "fingerprint", "first_divergence", "free_port", "fused_decode_enabled",
    "fused_decode_unsupported", "git_state", "home", "is_pulled", "largest_cache_bytes", "latest",
    "missing_provenance", "model_path", "parallel_region_cost", "parse_cpu_list", "physical_cores",
    "prompt_logits", "pull", "quantize_w4", "read", "require_clean", "select_w4_kernel",
    "serve_process", "serve_start", "serve_stop", "siblings", "tick_slack", "token_windows",
    "utc_now", "versions", "vllm_env",
]


def parallel_region_cost(reps: int) -> float:
    """Seconds to enter and leave `reps` empty parallel regions (at::parallel_for) at torch's
    thread count, timed inside our kernel library (built on first use)."""
    from edge_infer.kernels import ext

    return ext.load().parallel_region_cost(reps)


# dot_peak's kinds: the instruction and the multiply-accumulates one of them does
DOT_PEAK_KINDS = {0: ("vpdpbusd zmm (int8, AVX512-VNNI)", 64),
                  1: ("vdpbf16ps zmm (bf16, AVX512-BF16)", 32),
                  2: ("vfmadd231ps ymm (fp32, FMA)", 8),
                  3: ("vpmaddubsw+vpmaddwd ymm (int8, AVX2)", 32)}


def dot_peak(kind: int, iters: int) -> float:
    """Wall seconds for every torch thread to run `iters` rounds of 12 independent chains of
    one dot instruction (DOT_PEAK_KINDS) on registers: the arithmetic ceiling a compute-bound
    kernel is held against. Refuses a kind this CPU lacks."""
    from edge_infer.kernels import ext

    return ext.load().dot_peak(kind, iters)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
