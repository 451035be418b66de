"""ExecuTorch (XNNPACK) as an engine: the phone path's `.pte`, timed on this CPU with
llama-bench's protocol beside llama.cpp and ours.

The graph is the one `edge-infer export` ships (edge_export.decoder.StaticDecoder): a static
KV cache that the host owns, fixed shapes, lowered whole to XNNPACK. One `.pte` holds two
methods over the same context of CONTEXT slots: `prefill` takes CHUNK new tokens, `decode`
one. Builds:
- fp32: the HF weights upcast, as the fp32 export row of docs/results/export.md;
- 8da4w: int8 dynamic activations x int4 weights in groups of GROUP, the tied head at int8
  per channel (edge_export.xnnpack.lower.scheme_recipe, the export's default). The export
  also folds SmoothQuant scales from calibration text into the norms first; that changes
  values, not the graph or its cost, so the timing build skips it (no corpus is needed).

pp(n): ceil(n / CHUNK) prefill calls from an empty cache, the last chunk padded (the padding
is computed, never attended to: it comes after every real token). tg(n): n decode calls from
an empty cache, each writing its key/value into the next host slot. Each call's graph
concatenates its past (CONTEXT - chunk slots, masked where empty) with the new keys and
attends over all of it: the cost of a static cache, which a phone deployment of this graph
pays too. The .pte is built once per (model, build) in the planning process (minutes) and
cached under <edge-infer home>/harness/executorch. The XNNPACK thread pool is set to the run's
threads; its threads inherit the pinned child's cores.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from edge_harness.bench.weights import source_params
from edge_harness.runners.base import Build, ModelRef, random_ids

CONTEXT = 512  # slots of the static cache: pp512 fits, as llama-bench's default test needs
CHUNK = 128  # new tokens per prefill call
GROUP = 32  # 8da4w weight group (XNNPACK delegates multiples of 32; the export's default)
METHODS = {"prefill": CHUNK, "decode": 1}
# the graph's code: a change to any of these files is a different .pte
_SOURCES = ("decoder.py", "xnnpack/lower.py")


def pte_dir() -> Path:
    from edge_harness.bench.gguf_build import harness_home

    return harness_home() / "executorch"


def _graph_hash() -> str:
    import edge_export

    root = Path(edge_export.__file__).parent
    h = hashlib.sha256(f"{CONTEXT}/{CHUNK}/{GROUP}".encode())
    for name in _SOURCES:
        h.update((root / name).read_bytes())
    return h.hexdigest()[:12]


def build_pte(model: ModelRef, quant: str, out: Path) -> dict[str, int]:
    """Export `model` at `quant` into `out` (atomically), its rotary tables beside it; returns
    what the child and the roofline need: the static shapes, the cache's geometry, and the
    bytes of the embedding table and of one row of it (a decode step reads a row)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from transformers import AutoModelForCausalLM

    from edge_export.decoder import FLOAT_MASK_VALUE, StaticDecoder, StaticShape, example_inputs
    from edge_export.xnnpack.lower import quantize_in_place

    t0 = time.perf_counter()
    print(f"executorch: exporting {model.name} {quant} (context {CONTEXT}; minutes)",
          file=sys.stderr)
    hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=torch.float32).eval()
    decoder = StaticDecoder(hf, "xnnpack", FLOAT_MASK_VALUE).eval()
    embed = decoder.embed_tokens.weight
    layers, kv_heads, _, head_dim = decoder.cache_shape(0)
    facts = {"embed_bytes": embed.numel() * embed.element_size(),
             "embed_row_bytes": embed.shape[1] * embed.element_size(),
             "context": CONTEXT, "prefill_chunk": CHUNK,
             "cache": [layers, kv_heads, head_dim]}
    # the rotary tables of every position, from the HF model's own rotary module: the host
    # gives each call its positions' rows (the child loads the .pte, never the HF model)
    cos, sin = decoder.rope(torch.arange(CONTEXT))
    torch.save({"cos": cos.contiguous(), "sin": sin.contiguous()}, out.with_suffix(".rope.pt"))
    with torch.no_grad():
        quantize_in_place(decoder, quant, GROUP)
        programs = {
            name: torch.export.export(decoder, example_inputs(decoder, StaticShape(t, CONTEXT)))
            for name, t in METHODS.items()
        }
    print("executorch: lowering to XNNPACK", file=sys.stderr)
    edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_bytes(edge.to_executorch().buffer)
    os.replace(tmp, out)
    print(f"executorch: {out.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return facts


class ExecuTorchRunner:
    name = "executorch"
    quants = ("fp32", "8da4w")
    full_precision = None  # timing only: the export's own fidelity is its SQNR (export.md)
    profiler = False

    # -- planning side -------------------------------------------------------------------
    @classmethod
    def accepts(cls, quant: str) -> bool:
        return quant in cls.quants

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        import json

        from filelock import FileLock

        if quant not in cls.quants:
            raise ValueError(f"executorch builds {cls.quants}, not {quant!r}")
        try:
            import edge_export  # noqa: F401
        except ImportError:
            from edge_infer.api import UsageError

            raise UsageError("engine executorch needs the export package: install "
                             "edge-infer-export beside the harness (nox -s bench-x86 does)") from None
        out = pte_dir() / f"{model.name}-{quant}-{_graph_hash()}.pte"
        meta = out.with_suffix(".json")
        with FileLock(str(out) + ".lock"):
            if not (out.is_file() and meta.is_file()):
                meta.write_text(json.dumps(build_pte(model, quant, out)))
        facts = json.loads(meta.read_text())
        params = source_params(model.hf_dir)
        size = out.stat().st_size
        # a decode step reads every weight but the embedding table, of which it reads a row
        per_token = size - facts["embed_bytes"] + facts["embed_row_bytes"]
        return Build(cls.name, model.name, quant, str(out), 8 * size / params, per_token,
                     model.token_range)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(threads)}

    # -- child side ----------------------------------------------------------------------
    def load(self, build: Build, threads: int, n_ctx: int) -> dict[str, Any]:
        import json
        from importlib.metadata import version

        import torch
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        from edge_export.decoder import FLOAT_MASK_VALUE, chunk_mask

        path = Path(build.path)
        meta = json.loads(path.with_suffix(".json").read_text())
        rope = torch.load(path.with_suffix(".rope.pt"))
        context = meta["context"]
        if n_ctx > context:
            raise ValueError(f"{build.path} has a static context of {context} slots; this run "
                             f"needs {n_ctx} (pp/tg lengths up to {context})")
        torch.set_num_threads(threads)  # the host-side cache updates
        portable_lib._unsafe_reset_threadpool(threads)
        self.torch = torch
        self.mask_value = FLOAT_MASK_VALUE  # the XNNPACK graphs' mask (StaticDecoder)
        self.chunk_mask = chunk_mask  # the same mask the export scored its graphs with
        self.context, self.chunk = context, meta["prefill_chunk"]
        layers, kv_heads, head_dim = meta["cache"]
        self.cache_shape = lambda slots: (layers, kv_heads, slots, head_dim)
        self.cos, self.sin = rope["cos"], rope["sin"]
        program = Runtime.get().load_program(path)
        self.methods = {name: program.load_method(name) for name in METHODS}
        self.token_range = build.token_range
        return {
            "version": f"executorch {version('executorch')} (XNNPACK, "
                       f"executorch.runtime) + torch {torch.__version__}",
            "threads": portable_lib._threadpool_get_thread_count(),
            "prefix_caching": False,
            "act_dtype": "int8 (dynamic, per token)" if build.quant == "8da4w" else "float32",
            "static_context": context,
            "prefill_chunk": self.chunk,
        }

    def _call(self, method: str, tokens: list[int], start: int, k, v):
        """One call of `method` on `tokens` at absolute position `start`; the caches hold
        `start` valid slots. Returns (logits, k_new, v_new) of the new tokens."""
        torch = self.torch
        t = len(tokens)
        past = self.context - t
        args = [torch.tensor([tokens], dtype=torch.int32), self.cos[start:start + t],
                self.sin[start:start + t], self.chunk_mask(t, past, start, self.mask_value), k, v]
        return self.methods[method].execute(args)

    def _cache(self, method: str):
        steps = self.chunk if method == "prefill" else 1
        return self.torch.zeros(self.cache_shape(self.context - steps))

    def pp(self, n: int, seed: int) -> float:
        ids = random_ids(n, self.token_range, seed)
        pad = -n % self.chunk
        ids += [0] * pad
        k, v = self._cache("prefill"), self._cache("prefill")
        t0 = time.perf_counter()
        for start in range(0, len(ids), self.chunk):
            _, k_new, v_new = self._call("prefill", ids[start:start + self.chunk], start, k, v)
            if start + self.chunk < len(ids):
                k[:, :, start:start + self.chunk] = k_new
                v[:, :, start:start + self.chunk] = v_new
        return time.perf_counter() - t0

    def tg(self, n: int, seed: int) -> float:
        ids = random_ids(n, self.token_range, seed)
        k, v = self._cache("decode"), self._cache("decode")
        t0 = time.perf_counter()
        for pos, tok in enumerate(ids):
            _, k_new, v_new = self._call("decode", [tok], pos, k, v)
            if pos + 1 < n:
                k[:, :, pos:pos + 1] = k_new
                v[:, :, pos:pos + 1] = v_new
        return time.perf_counter() - t0

    def close(self) -> None:
        self.methods = {}


RUNNER = ExecuTorchRunner
