"""vLLM's offline API with our profile: one place that builds an `LLM` for us."""

from __future__ import annotations

from edge_infer.kernels.cpu import activation_dtype
from edge_infer.serve.resolve import Resolved


def make_llm(r: Resolved, *, prefix_caching: bool | None = None, **overrides):
    import os

    # One process: skips a second 15-35 s `import vllm` in a spawned engine core, and lets
    # `LLM.apply_model` reach the model (tests, benchmarks).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    s = r.profile.serve
    kwargs = dict(
        model=str(r.path),
        dtype=activation_dtype(s.dtype),
        max_model_len=s.max_model_len,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.prefix_caching if prefix_caching is None else prefix_caching,
        max_num_seqs=s.max_num_seqs,
    )
    kwargs.update(overrides)
    return LLM(**kwargs)


def generate(r: Resolved, prompt: str, max_tokens: int, temperature: float, chat: bool) -> str:
    from vllm import SamplingParams

    llm = make_llm(r)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    else:
        out = llm.generate([prompt], params, use_tqdm=False)
    return out[0].outputs[0].text
