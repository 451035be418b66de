"""llama.cpp through llama-cpp-python's low-level API, timed the way llama-bench times it.

llama-bench (tools/llama-bench) per repetition: clear the KV cache, then
- pp: `llama_decode` of one batch of n ids (BOS first if the vocab adds one, then random ids)
  built with `llama_batch_get_one`, which asks for the logits of the last token only;
  then `llama_synchronize`;
- tg: n calls of `llama_decode` on one token each (BOS, then random ids), synchronizing after
  each; the cache starts empty.
Whether it measures what llama-bench measures is checked, not assumed: `edge-infer bench
crosscheck` runs the real llama-bench (built from the same sdist) beside this code on the same
GGUF, cores and guard, and records both (kind llama_bench_crosscheck in
docs/results/bench.jsonl, shown in docs/results/report.md).

Context settings follow llama-bench's defaults (n_batch 2048, n_ubatch 512, mmap on, f16 KV
cache). Flash attention is pinned on: llama-bench and the low-level defaults use "auto" (on
for CPU) while `Llama()` turns it off, and the two give different logits and speed.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

from edge_harness.bench import gguf_build
from edge_harness.bench.weights import gguf_build_facts, source_params
from edge_harness.runners.base import Build, ModelRef, random_ids

FLASH_ATTN = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED


class LlamaCppRunner:
    name = "llama.cpp"
    quants = ("bf16", "f16", "q4_k_m", "q4_0", "original")
    full_precision = "f16"  # as llama-perplexity's --kl-divergence-base is usually made
    profiler = False  # its graph runs in C: its step time is in bench run's tg

    # -- planning side -------------------------------------------------------------------
    @classmethod
    def accepts(cls, quant: str) -> bool:
        return quant in cls.quants

    @classmethod
    def tokenize(cls, model: ModelRef, text: str) -> tuple[list[int], int | None]:
        """llama.cpp's tokenizer of the model's full-precision GGUF, as llama-perplexity -f
        tokenizes (add_special on, special tokens not parsed)."""
        return tokenize_gguf(Path(cls.prepare(model, cls.full_precision).path), text)

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        if quant == "original":  # the published GGUF the model was pulled from
            if model.gguf is None:
                raise ValueError(f"{model.name} has no original GGUF (random weights?)")
            path = model.gguf
        else:
            path = gguf_build.build_gguf(model.name, model.hf_dir, quant)
        bits, per_token = gguf_build_facts(path, source_params(model.hf_dir))
        return Build(cls.name, model.name, quant, str(path), bits, per_token, model.token_range)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(threads)}

    # -- child side ----------------------------------------------------------------------
    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        import llama_cpp as lc

        self.lc = lc
        self._silence()
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(build.path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {build.path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = max(2048, n_ctx)
        cparams.n_ubatch = 512
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.flash_attn_type = FLASH_ATTN
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {build.path}")
        vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.bos = lc.llama_vocab_bos(vocab) if lc.llama_vocab_get_add_bos(vocab) else None
        self.n_batch = cparams.n_batch
        self.token_range = min(build.token_range, self.n_vocab)
        self.mem = lc.llama_get_memory(self.ctx)
        self.threads = threads
        return {
            "version": f"llama-cpp-python {lc.__version__} ({_system_info(lc)})",
            "threads": lc.llama_n_threads(self.ctx),
            "threads_batch": lc.llama_n_threads_batch(self.ctx),
            "prefix_caching": False,  # the cache is cleared before every repetition
            "flash_attn": "on",
            "n_ctx": lc.llama_n_ctx(self.ctx),
            "n_batch": self.n_batch,
            "n_ubatch": cparams.n_ubatch,
        }

    def _silence(self) -> None:
        # llama.cpp logs every tensor at load; keep warnings and errors only.
        lc = self.lc

        @lc.llama_log_callback
        def _log(level, text, user_data):
            if level >= 3:  # GGML_LOG_LEVEL_WARN and above
                os.write(2, text)

        self._log_cb = _log  # keep a reference: C holds only the pointer
        lc.llama_log_set(_log, ctypes.c_void_p(0))

    def _decode(self, ids: list[int]) -> None:
        arr = (self.lc.llama_token * len(ids))(*ids)
        rc = self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def pp(self, n: int, seed: int) -> float:
        lc = self.lc
        ids = random_ids(n, self.token_range, seed, first=self.bos)
        lc.llama_memory_clear(self.mem, False)
        t0 = time.perf_counter()
        for i in range(0, n, self.n_batch):  # one batch when n <= n_batch, as in llama-bench
            self._decode(ids[i:i + self.n_batch])
        lc.llama_synchronize(self.ctx)
        return time.perf_counter() - t0

    def tg(self, n: int, seed: int) -> float:
        lc = self.lc
        ids = random_ids(n, self.token_range, seed, first=self.bos)
        lc.llama_memory_clear(self.mem, False)
        t0 = time.perf_counter()
        for tok in ids:
            self._decode([tok])
            lc.llama_synchronize(self.ctx)
        return time.perf_counter() - t0

    # -- fidelity (edge_harness.fidelity): full-vocabulary logits and greedy decoding ---------
    def logprobs(self, ids: list[int], first: int):
        """log-softmax rows [len(ids) - 1 - first, vocab]: row r is the distribution of token
        first + r + 1, from one decode of `ids` on an empty cache (llama-perplexity's scoring)."""
        import numpy as np
        import torch

        lc = self.lc
        n = len(ids)
        if n > self.n_batch:
            raise ValueError(f"{n} ids exceed n_batch {self.n_batch}")
        lc.llama_memory_clear(self.mem, True)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i, tok in enumerate(ids):
                batch.token[i] = tok
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i >= first
            batch.n_tokens = n
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            rows = []
            for i in range(first, n - 1):
                ptr = lc.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        finally:
            lc.llama_batch_free(batch)
        return torch.log_softmax(torch.from_numpy(np.stack(rows)).float(), dim=-1)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n argmax tokens after `ids` (past end-of-generation, as our engine's ignore_eos)."""
        import numpy as np

        lc = self.lc
        lc.llama_memory_clear(self.mem, True)
        out: list[int] = []
        self._decode(list(ids))
        for _ in range(n):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            tok = int(logits.argmax())
            out.append(tok)
            if len(out) < n:
                self._decode([tok])
        return out

    def close(self) -> None:
        lc = getattr(self, "lc", None)
        if lc is None:
            return
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None


def tokenize_gguf(gguf: Path, text: str) -> tuple[list[int], int | None]:
    """(ids, bos or None) with llama.cpp's tokenizer of `gguf`, as llama-perplexity does."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        bos = llama_cpp.llama_vocab_bos(vocab) if add_bos else None
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    finally:
        llm.close()
    return ids, bos


def _system_info(lc) -> str:
    info = lc.llama_print_system_info().decode(errors="replace")
    keep = [p.strip() for p in info.replace("|", ";").split(";")
            if "= 1" in p and any(k in p for k in ("AVX", "FMA", "F16C", "OPENMP", "AMX"))]
    return ", ".join(k.split("=")[0].strip() for k in keep) or info[:80]



RUNNER = LlamaCppRunner
