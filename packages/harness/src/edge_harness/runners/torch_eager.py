"""Plain PyTorch eager (transformers) as a floor: what the same weights do with no engine.

pp: one forward over n random ids on an empty cache with `logits_to_keep=1` (the last
position's logits only, as llama-bench's pp). tg: n single-token forwards through a
DynamicCache that starts empty (BOS first, then random ids). Threads: torch.set_num_threads.
Fidelity: the same forward over the whole chunk for log-probs, and greedy decoding through a
DynamicCache, on the HF folder's own tokens.
"""

from __future__ import annotations

import time
from typing import Any

from edge_harness.bench.weights import hf_build_facts, source_params
from edge_harness.runners.base import Build, ModelRef, random_ids

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class TorchRunner:
    name = "torch"
    quants = tuple(DTYPES)
    full_precision = "bf16"  # the HF folder as stored (ours' base too); fp32 is scored against it
    profiler = False

    @classmethod
    def accepts(cls, quant: str) -> bool:
        return quant in cls.quants

    @classmethod
    def tokenize(cls, model: ModelRef, text: str) -> tuple[list[int], int | None]:
        """The HF folder's own tokenizer, BOS first when it adds one (as llama-perplexity)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model.hf_dir)
        bos = tok.bos_token_id
        if bos is None or tok("")["input_ids"][:1] != [bos]:
            bos = None
        ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
        return ([bos] if bos is not None else []) + ids, bos

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        if quant not in DTYPES:
            raise ValueError(f"torch eager runs {tuple(DTYPES)}, not {quant!r}")
        params = source_params(model.hf_dir)
        bits, per_token = hf_build_facts(model.hf_dir, params)
        if quant == "fp32":  # upcast at load: twice the bytes of the bf16 files
            bits, per_token = 2 * bits, 2 * per_token
        return Build(cls.name, model.name, quant, str(model.hf_dir), bits, per_token,
                     model.token_range)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(threads)}

    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            build.path, dtype=getattr(torch, DTYPES[build.quant])
        ).eval()
        self.token_range = build.token_range
        self.bos = self.model.config.bos_token_id
        return {
            "version": f"torch {torch.__version__} + transformers {transformers.__version__}",
            "threads": torch.get_num_threads(),
            "prefix_caching": False,
            "attn_implementation": self.model.config._attn_implementation,
        }

    def pp(self, n: int, seed: int) -> float:
        torch = self.torch
        ids = torch.tensor([random_ids(n, self.token_range, seed, first=self.bos)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    def tg(self, n: int, seed: int) -> float:
        from transformers import DynamicCache

        torch = self.torch
        ids = random_ids(n, self.token_range, seed, first=self.bos)
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            t0 = time.perf_counter()
            for tok in ids:
                self.model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                           use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    # -- fidelity (edge_harness.fidelity) ----------------------------------------------
    def logprobs(self, ids: list[int], first: int):
        """log-softmax rows [len(ids) - 1 - first, vocab] from one forward of `ids`."""
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits
        return torch.log_softmax(logits[0, first:len(ids) - 1].float(), dim=-1)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n argmax tokens after `ids` through a DynamicCache, past any end-of-generation."""
        from transformers import DynamicCache

        torch = self.torch
        cache = DynamicCache(config=self.model.config)
        out: list[int] = []
        step = list(ids)
        with torch.inference_mode():
            while len(out) < n:
                logits = self.model(input_ids=torch.tensor([step]), past_key_values=cache,
                                    use_cache=True, logits_to_keep=1).logits
                out.append(int(logits[0, -1].argmax()))
                step = out[-1:]
        return out

    def close(self) -> None:
        self.model = None


RUNNER = TorchRunner
