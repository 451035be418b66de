"""Compile, ahead of the first request, the sampler helpers vLLM runs through torch.compile.

vLLM 0.32 compiles two small functions with inductor on CPU the first time a request needs
them: `batched_count_greater_than` (any `logprobs` / `prompt_logprobs`) and
`compiled_random_sample` (sampling at temperature > 0). On 2 cores the first logprobs request
waited ~12 s for it. Run once at image build (or `python -m edge_infer.serve.warm`), with
TORCHINDUCTOR_CACHE_DIR pointing where serve points it (runtime.vllm_env), and a server's
first such request loads the compiled code from that cache instead.
"""

from __future__ import annotations

import argparse
import time


def warm(vocab: int) -> float:
    """Compile both helpers for [batch, vocab] fp32 logits (a fixed batch of 1, then the
    dynamic-batch variant a second size triggers); seconds taken."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample

    t0 = time.perf_counter()
    for batch in (1, 3):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
        counts = batched_count_greater_than(logits, logits[:, :1])
        assert counts.shape == (batch,)
        assert compiled_random_sample(logits).shape == (batch,)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, required=True, help="the served model's vocabulary size")
    args = p.parse_args()
    print(f"edge-infer: sampler helpers compiled in {warm(args.vocab):.1f} s")


if __name__ == "__main__":
    main()
