"""llama.cpp timed by llama-bench itself: the reference numbers people quote and rerun.

Each repetition the benchmark loop asks for is one invocation of the real `llama-bench` (built
by bench.llama_tools from the llama-cpp-python sdist our llama.cpp runner links):
    llama-bench -m GGUF -p N -n 0 -r 1 -t T -o json      (pp N)
    llama-bench -m GGUF -p 0 -n N -r 1 -t T -o json      (tg N)
with llama-bench's own defaults otherwise (its warm-up, flash attention auto, n_batch 2048,
n_ubatch 512, f16 KV cache, mmap, polling). It starts from the pinned child, so it inherits
the child's cores, and the contention guard watches it as part of the child's process tree.
The time returned is llama-bench's own sample (`samples_ns`), which excludes its model load
and warm-up; the whole JSON entry of each repetition goes into the record. llama-bench draws
its own random tokens, so `seed` is not used.

Next to runners/llamacpp.py (our re-implementation of the same loop through the Python
bindings, which fidelity needs for logits): `edge-infer bench crosscheck` compares the two.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge_harness.bench.gguf_build import LLAMA_CPP_PYTHON
from edge_harness.bench.llama_tools import (
    LLAMA_BATCHED_BENCH,
    LLAMA_BENCH,
    batched_bench_args,
    llama_bench_args,
    parse_batched_bench,
    parse_llama_bench,
    tool_env,
    tool_path,
    tool_version,
)
from edge_harness.runners.base import Build, ModelRef
from edge_harness.runners.llamacpp import LlamaCppRunner


class LlamaBenchRunner:
    name = LLAMA_BENCH
    quants = LlamaCppRunner.quants
    # a separate binary that prints timings only: no logits to score (fidelity refuses it;
    # score llama.cpp:QUANT, the same GGUF) and no per-op profile
    full_precision = None
    profiler = False
    # bench batched runs llama.cpp's own llama-batched-bench (same build, same GGUF)
    batched_engine = LLAMA_BATCHED_BENCH

    # -- planning side -------------------------------------------------------------------
    @classmethod
    def accepts(cls, quant: str) -> bool:
        return quant in cls.quants

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        build = LlamaCppRunner.prepare(model, quant)  # the same GGUF as the llama.cpp runner
        tool_path(LLAMA_BENCH)  # built once (minutes), here rather than inside a timed child
        tool_path(LLAMA_BATCHED_BENCH)  # the same build
        return replace(build, engine=cls.name)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(threads)}

    # -- child side ----------------------------------------------------------------------
    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        self.binary: Path = tool_path(LLAMA_BENCH)
        self.gguf = build.path
        self.threads = threads
        self.last_extra: dict | None = None
        v = tool_version(self.binary)
        return {
            "version": f"{LLAMA_BENCH} {v['build_commit']} (build {v['build_number']}, "
                       f"{v['version']}, llama-cpp-python {LLAMA_CPP_PYTHON} sdist, "
                       f"{v['compiler']})",
            "build_commit": v["build_commit"],
            "threads": threads,
            "prefix_caching": False,  # every invocation starts from an empty cache
            "flash_attn": "auto (llama-bench default)",
            "n_batch": 2048,
            "n_ubatch": 512,
        }

    @staticmethod
    def _run_tool(name: str, args: list[str]) -> str:
        """Run one of llama.cpp's tools (args[0]) to completion: its stdout, or a RuntimeError
        with the command and the last lines it printed."""
        proc = subprocess.run(args, capture_output=True, text=True, env=tool_env(Path(args[0])))
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
            raise RuntimeError(f"{name} exited {proc.returncode} ({' '.join(args)}):\n{tail}")
        return proc.stdout

    def _invoke(self, test: str, n: int) -> float:
        n_prompt, n_gen = (n, 0) if test == "pp" else (0, n)
        stdout = self._run_tool(LLAMA_BENCH, llama_bench_args(self.binary, self.gguf, n_prompt,
                                                              n_gen, self.threads))
        entry = parse_llama_bench(stdout, self.threads).get(test)
        if entry is None or entry.get(f"n_{'prompt' if test == 'pp' else 'gen'}") != n:
            raise RuntimeError(f"{LLAMA_BENCH} printed no {test}{n} result: {stdout[:200]!r}")
        samples = entry.get("samples_ns") or []
        if len(samples) != 1 or samples[0] <= 0:
            raise RuntimeError(f"{LLAMA_BENCH}: expected one positive sample, got {samples!r}")
        self.last_extra = entry
        return samples[0] / 1e9

    def batched(self, n: int, seed: int, batch: int) -> float:
        """n decode steps of `batch` sequences together, timed by llama-batched-bench (its
        t_tg); its JSONL entry becomes last_extra. It draws its own tokens: `seed` is unused."""
        args = batched_bench_args(tool_path(LLAMA_BATCHED_BENCH), self.gguf, n, batch,
                                  self.threads)
        entry = parse_batched_bench(self._run_tool(LLAMA_BATCHED_BENCH, args), n, batch,
                                    self.threads)
        self.last_extra = entry
        return float(entry["t_tg"])

    def pp(self, n: int, seed: int) -> float:
        return self._invoke("pp", n)

    def tg(self, n: int, seed: int) -> float:
        return self._invoke("tg", n)

    def close(self) -> None:
        pass


RUNNER = LlamaBenchRunner
