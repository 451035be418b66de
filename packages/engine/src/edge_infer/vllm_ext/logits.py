"""Full-vocabulary logits of every prompt position, out of a running vLLM `LLM`.

vLLM returns at most `max_logprobs` logprobs per position as Python objects; parity and
fidelity work needs the whole distribution (KL divergence). Asking for prompt logprobs makes
vLLM compute the logits of every prompt position in one `compute_logits` call; a forward hook
on the model's `logits_processor` keeps that tensor. Needs the model in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as `serve.offline.make_llm` sets) and the prompt in one
prefill chunk (max_num_batched_tokens >= its length).
"""

from __future__ import annotations

import torch


def prompt_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(token_ids) - 1, vocab]: row i is the distribution of token i + 1."""
    from vllm import SamplingParams, TokensPrompt

    calls: list[torch.Tensor] = []

    def keep(_module, _args, out):
        calls.append(out.detach().float().cpu().clone())

    (handle,) = llm.apply_model(lambda model: model.logits_processor.register_forward_hook(keep))
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
        llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, use_tqdm=False)
    finally:
        handle.remove()
    rows = len(token_ids) - 1
    prompt = [c for c in calls if c.shape[0] == rows]
    if len(prompt) != 1:
        shapes = [tuple(c.shape) for c in calls]
        raise RuntimeError(f"expected one logits call of {rows} rows (one prefill chunk); got "
                           f"{shapes}: raise max_num_batched_tokens to the prompt length")
    return prompt[0]
