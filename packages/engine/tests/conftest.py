import os
import subprocess
import sys

# edge_home (a private EDGE_INFER_HOME) and smollm2 (the default model, pulled into it)
pytest_plugins = ["edge_infer.testing"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_infer", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def decode_against_scoring(engine, ids: list[int], n: int) -> tuple[list[float], int]:
    """Greedy-decode n tokens after `ids`, then score prompt + those tokens in one prefill:
    per generated token |decode logprob - scored logprob|, and how many decode steps the
    fused decode path (edge_infer.vllm_ext.fused) ran. The two forwards see the same tokens,
    so they agree up to rounding whatever the model's logits look like."""
    from vllm import SamplingParams, TokensPrompt

    (out,) = engine.generate(TokensPrompt(prompt_token_ids=ids),
                             SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                            logprobs=0), use_tqdm=False)
    gen = list(out.outputs[0].token_ids)
    decoded = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, gen, strict=True)]
    (scored,) = engine.generate(TokensPrompt(prompt_token_ids=ids + gen),
                                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                                use_tqdm=False)
    want = [scored.prompt_logprobs[len(ids) + i][t].logprob for i, t in enumerate(gen)]
    (steps,) = engine.apply_model(lambda m: getattr(m.__dict__.get("_edge_fused"), "steps", 0))
    return [abs(a - b) for a, b in zip(decoded, want, strict=True)], steps
