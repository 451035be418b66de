"""`edge-infer fidelity`: every build against its own engine's full-precision build.

For each model: the chat-formatted greedy prompts are made once, as token ids, and fed to
every build; the corpus chunks (edge_harness.fidelity.chunks) are made once per tokenizer, as
each engine's runner tokenizes, and fed to every build of the engines that share it. Per engine,
its base build (the runner's `full_precision`: ours bf16, llama.cpp f16) runs first in a pinned
child and keeps its log-prob rows on disk; then each build of that engine runs in its own child
and is scored against them. Runners that declare no full-precision build only time (llama-bench)
and are refused. One record per
(model, build): greedy exact matches and first divergences, llama-perplexity's statistics over
all corpora together and per corpus, bits/weight from the files, the grid the weights came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from edge_harness.bench.run import EngineSpec, resolve_model
from edge_harness.fidelity import score
from edge_harness.fidelity.chunks import Chunks, make_chunks
from edge_harness.fidelity.metrics import KLAccumulator
from edge_harness.isolation.child import Worker, bench_lock
from edge_harness.runners import get_runner, locate, runners
from edge_harness.runners.base import Build, ModelRef
from edge_infer.api import (
    GREEDY_PROMPTS,
    Guard,
    UsageError,
    append,
    choose_cores,
    command_line,
    context,
    first_divergence,
)


@dataclass
class FidelityPlan:
    models: list[str]
    builds: list[EngineSpec]
    corpora: list[str] = field(default_factory=lambda: ["lee", "shakespeare"])
    chunks: int = 8
    n_ctx: int = 512
    prompts: int = len(GREEDY_PROMPTS)
    n_gen: int = 32
    cores: str | None = None
    threads: int | None = None
    results: Path | None = None
    command: str = ""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def source_grid(name: str) -> str:
    from edge_infer.api import REGISTRY

    entry = REGISTRY.get(name)
    if entry is None:
        return "unknown (a local folder)"
    return getattr(entry.source, "grid", None) or "none (random weights)"


def chat_prompts(model: ModelRef, count: int) -> list[list[int]]:
    if count <= 0:
        return []
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.hf_dir)
    if not tok.chat_template:
        raise UsageError(f"{model.name} has no chat template: greedy prompts need one "
                         "(use --prompts 0 for corpus statistics only)")
    out = []
    for p in GREEDY_PROMPTS[:count]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=False)
        # the template already holds any BOS it wants: add no special tokens again
        out.append([int(i) for i in tok(text, add_special_tokens=False)["input_ids"]])
    return out


class FidelityRun:
    def __init__(self, plan: FidelityPlan):
        self.plan = plan
        self.cores = choose_cores(plan.cores, plan.threads)
        self.records: list[dict] = []

    def run(self) -> list[dict]:
        p = self.plan
        if not p.builds:
            raise UsageError("no builds to score (-b)")
        for spec in p.builds:
            if get_runner(spec.engine).full_precision is None:
                scorers = sorted(n for n, r in runners().items() if r.full_precision is not None)
                raise UsageError(f"-b {spec.label}: {spec.engine} only times pp/tg (its runner "
                                 f"declares no full_precision build to score against); fidelity "
                                 f"scores {', '.join(scorers)}")
        with bench_lock(0.0):
            for name in p.models:
                self.model(resolve_model(name))
        return self.records

    def _worker(self, build: Build, label: str, n_ctx: int) -> tuple[Worker, dict]:
        """A pinned child with `build` loaded, and the facts it reports about the build."""
        runner = get_runner(build.engine)
        w = Worker(self.cores, runner.child_env(self.cores, len(self.cores), {}), label=label)
        facts = w.request("load", engine=locate(runner), build=build.to_dict(),
                          threads=len(self.cores), n_ctx=n_ctx)["facts"]
        return w, facts

    def model(self, model: ModelRef) -> None:
        p = self.plan
        say(f"fidelity {model.name}: preparing builds")
        prompts = chat_prompts(model, p.prompts)
        n_ctx = max([p.n_ctx] + [len(ids) + p.n_gen + 1 for ids in prompts])
        by_tokenizer: dict = {}  # runners that tokenize alike (ours uses llama.cpp's) share chunks
        for engine in dict.fromkeys(s.engine for s in p.builds):
            runner = get_runner(engine)
            if runner.tokenize not in by_tokenizer:
                by_tokenizer[runner.tokenize] = {
                    c: make_chunks(partial(runner.tokenize, model), c, p.n_ctx, p.chunks)
                    for c in p.corpora}
            chunks = by_tokenizer[runner.tokenize]
            ids_digest = hashlib.sha256(json.dumps(
                {c: ch.ids for c, ch in chunks.items()}).encode()).hexdigest()[:16]
            base = runner.prepare(model, runner.full_precision)
            folder = _cache() / model.name / f"{base.engine}-{base.quant}-{ids_digest}"
            key = {"build": build_fingerprint(base), "prompts": prompts, "n_gen": p.n_gen}
            base_greedy = cached_base(folder, chunks, key)
            label = f"{base.engine}:{base.quant}"
            if base_greedy is not None:
                say(f"fidelity {model.name}: base {label} (cached in {folder})")
            else:
                say(f"fidelity {model.name}: base {label}")
                (folder / "base.json").unlink(missing_ok=True)  # stale until rewritten below
                w, _ = self._worker(base, f"{model.name}-{base.engine}-{base.quant}", n_ctx)
                try:
                    for c, ch in chunks.items():
                        _on_runner(w, score.write_base, folder=str(folder), corpus=c,
                                   chunks=ch.ids, first=ch.first)
                    base_greedy = (_on_runner(w, score.greedy, prompts=prompts, n=p.n_gen)
                                   if prompts else [])
                finally:
                    w.close()
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "base.json").write_text(json.dumps({**key, "greedy": base_greedy}))
            for spec in (s for s in p.builds if s.engine == engine):
                build = runner.prepare(model, spec.quant)
                say(f"fidelity {model.name}: {spec.label} against {label}")
                self.score(model, base, build, folder, chunks, prompts, base_greedy, n_ctx)

    def score(self, model, base: Build, build: Build, folder: Path, chunks: dict[str, Chunks],
              prompts, base_greedy, n_ctx) -> None:
        p = self.plan
        t0 = time.monotonic()
        # not a timing, but its record gives the wall time: the guard says what ran beside it
        with Guard(self.cores).observe(f"fidelity {build.engine}:{build.quant}") as verdict:
            w, facts = self._worker(build, f"{model.name}-{build.engine}-{build.quant}", n_ctx)
            try:
                per_corpus = {}
                total = KLAccumulator()
                for c, ch in chunks.items():
                    r = _on_runner(w, score.compare, folder=str(folder), corpus=c,
                                   chunks=ch.ids, first=ch.first)
                    acc = KLAccumulator()
                    acc.extend(r)
                    total.extend(r)
                    per_corpus[c] = {**acc.summary(), "chunks": len(ch.ids),
                                     "corpus_tokens": ch.total_tokens}
                greedy = (_on_runner(w, score.greedy, prompts=prompts, n=p.n_gen)
                          if prompts else [])
            finally:
                w.close()
        divergences = [first_divergence(a, b) for a, b in zip(base_greedy, greedy, strict=True)]
        rec = {
            "kind": "fidelity",
            **context(threads=len(self.cores)),
            **verdict.fields(),
            "command": p.command or command_line(),
            "model": model.name,
            "source_grid": source_grid(model.name),
            "engine": build.engine,
            "engine_version": facts.get("version"),
            "quant": build.quant,
            "base": f"{base.engine}:{base.quant}",
            "bits_per_weight": round(build.bits_per_weight, 4),
            "base_bits_per_weight": round(base.bits_per_weight, 4),
            "cores": self.cores,
            "n_ctx": p.n_ctx,
            "scored_from": p.n_ctx // 2,
            "corpora": per_corpus,
            **total.summary(),
            "greedy_prompts": len(prompts),
            "greedy_tokens": p.n_gen,
            "greedy_exact": sum(d is None for d in divergences),
            "greedy_first_divergence": divergences,
            "seconds": round(time.monotonic() - t0, 1),
        }
        if "w4_kernels" in facts:
            rec["w4_kernels"] = facts["w4_kernels"]
        self.records.append(rec)
        if p.results is not None:
            append(p.results, rec)
        say(f"  {build.engine}:{build.quant}: {rec['bits_per_weight']:.2f} b/w, greedy "
            f"{rec['greedy_exact']}/{len(prompts)}, same top {rec['same_top_pct']:.2f}%, "
            f"mean KL {rec['kl_mean']:.5f}, KL p99 {rec['kl_p99']:.4f}, PPL ratio {rec['ppl_ratio']:.4f}")


def build_fingerprint(build: Build) -> str:
    """Which weights a build loads: its path and every file's size and mtime (cheap, and it
    changes when a model is pulled or quantized again)."""
    root = Path(build.path)
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    h = hashlib.sha256(f"{build.engine}:{build.quant}:{root.resolve()}".encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(root) if root.is_dir() else f.name}:{st.st_size}:"
                     f"{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cached_base(folder: Path, chunks: dict[str, Chunks], key: dict) -> list | None:
    """The base build's greedy continuations when its log-prob files in `folder` are complete
    and were written by the same weights for the same prompts (else None: recompute). The
    folder name already pins the chunks' token ids."""
    try:
        saved = json.loads((folder / "base.json").read_text())
    except (OSError, ValueError):
        return None
    if {k: saved.get(k) for k in key} != key:
        return None
    for c, ch in chunks.items():
        data, meta = score.base_path(folder, c)
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if info.get("chunks") != len(ch.ids) or info.get("first") != ch.first or not data.is_file():
            return None
        if data.stat().st_size != 4 * info["chunks"] * info["rows"] * info["vocab"]:
            return None  # truncated
    return saved.get("greedy")


def _on_runner(w: Worker, fn, **kwargs):
    """fn(runner, **kwargs) in the child, on the build it has loaded."""
    return w.request("on_runner", fn=f"{fn.__module__}:{fn.__name__}", kwargs=kwargs)["result"]


def _cache() -> Path:
    from edge_infer.api import home

    return home() / "fidelity"


def default_results() -> Path:
    return Path(os.environ.get("EDGE_INFER_RESULTS", "docs/results")) / "fidelity.jsonl"
