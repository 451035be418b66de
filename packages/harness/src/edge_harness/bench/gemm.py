"""GEMM microbenchmark: each 4-bit kernel (each scheme it runs: w4a16, w4a8) against bf16 /
fp32 `F.linear`.

Shapes are the linear layers our engine runs for a model, as vLLM fuses them: qkv_proj
[(q+2kv) x head_dim, hidden], o_proj [hidden, q x head_dim], gate_up_proj [2 x ffn, hidden],
down_proj [hidden, ffn]; at M=1 (a decode step) and M=512 (a pp512 prefill). Weights are random
N(0, 0.02), quantized with `edge_infer.api.quantize_w4` at the model's group size
and prepacked by each kernel (`edge_infer.api.W4_KERNELS`), exactly as the engine loads
them.

Per call: GFLOP/s = 2*M*N*K / t; GB/s = bytes of the weights as the kernel holds them (its
prepacked tensors: codes, scales, zero terms) / t. At M=1 a kernel is memory-bound and GB/s is
the number to hold against the streaming ceiling; at M=512 it is compute-bound and GFLOP/s is.

Runs inside a pinned child (see bench.run) with torch's thread count set to the benchmark's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

MS = (1, 512)
# Up to this many rows a call is a (batched) decode step: a serving engine batches at most
# tens of sequences per step, each step streaming every layer's weights from memory.
DECODE_M_MAX = 64


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    h = config["hidden_size"]
    nq = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads", nq)
    d = config.get("head_dim") or h // nq
    f = config["intermediate_size"]
    shapes = {
        "qkv_proj": ((nq + 2 * nkv) * d, h),
        "o_proj": (h, nq * d),
        "gate_up_proj": (2 * f, h),
        "down_proj": (h, f),
    }
    if config.get("vocab_size"):  # the LM head: one per decode step, often the largest
        shapes["lm_head"] = (config["vocab_size"], h)
    return shapes


def _time(run, n_copies: int, min_time: float, min_samples: int = 5,
          max_samples: int = 50) -> list[float]:
    """Seconds per call, as the mean of batches of >= ~10 ms. `run(i, k)` makes k calls back
    to back, the j-th on weight copy (i + j) % n_copies (see cold_bytes), and returns their
    seconds; the copies rotate across batches."""
    run(0, n_copies)  # warm-up: one pass over every copy (first calls convert scales)
    batch = max(1, int(0.01 / max(run(0, 1), 1e-7)))
    out: list[float] = []
    i = 0
    start = time.perf_counter()
    while len(out) < max_samples and (len(out) < min_samples
                                      or time.perf_counter() - start < min_time):
        out.append(run(i % n_copies, batch) / batch)
        i += batch
    return out


def _op_calls(fn, copies: list, x):
    """run(i, k) for _time: k calls of the op from Python, as the engine's layers make them."""
    def run(i: int, k: int) -> float:
        t0 = time.perf_counter()
        for j in range(i, i + k):
            fn(x, copies[j % len(copies)])
        return time.perf_counter() - t0
    return run


# Decode streams every layer's weights from memory: a layer timed on one resident copy would
# be served from cache (a 576x576 layer is 0.2-1.3 MB) and report cache, not DRAM, bandwidth.
# So each call uses the next of enough copies to span cold_bytes(): 4x the largest cache the
# kernel reports, and never under 256 MiB (a 2-core cloud slice of a server CPU can see the
# host's whole L3: 260 MiB on an Intel Xeon measured here).
COLD_BYTES = 256 << 20
MAX_COPIES = 4096


def cold_bytes() -> int:
    from edge_infer.api import largest_cache_bytes

    return max(COLD_BYTES, 4 * largest_cache_bytes())


def _nbytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


def _copies(obj, nbytes: int) -> list:
    import torch

    n = max(1, min(MAX_COPIES, -(-cold_bytes() // max(nbytes, 1))))

    def clone(o):
        if isinstance(o, torch.Tensor):
            return o.clone()
        if isinstance(o, dict):
            return {k: clone(v) for k, v in o.items()}
        return o

    return [obj] + [clone(obj) for _ in range(n - 1)]


DISPATCHED = "dispatched"  # --kernels: only the kernel the engine picks per shape and scheme


def measure(model: str, hf_dir: str, group: int, threads: int, min_time: float = 0.3,
            ms: list[int] | None = None, kernels: list[str] | None = None) -> list[dict]:
    """Time every implementation on every layer shape of one model (called in the child)."""
    import torch
    import torch.nn.functional as F

    from edge_infer.api import SCHEMES, W4_KERNELS, quantize_w4, select_w4_kernel

    torch.set_num_threads(threads)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layer, (n, k) in linear_shapes(config).items():
        if kernels == [DISPATCHED]:  # what the engine runs for this shape, per scheme
            names = sorted({select_w4_kernel(n, k, group, scheme=s).name for s in SCHEMES})
        else:
            names = kernels or [k for k, cls in W4_KERNELS.items() if cls.available()]
        w = torch.randn(n, k, generator=gen) * 0.02
        q, scale, zero = quantize_w4(w, group, False, torch.bfloat16)
        # (implementation, quant, activation dtype, weights as held, call(x, weights))
        impls = []
        for name in names:
            kern = W4_KERNELS[name]
            if hasattr(kern, "supports") and not kern.supports(n, k, group):
                continue  # the engine's per-shape dispatch would not pick it either
            for scheme in kern.schemes:
                if name == "reference" and scheme != "w4a16":
                    continue  # the oracle, timed once
                impls.append((name, scheme, torch.bfloat16,
                              kern.prepack(q, scale, zero, group, torch.bfloat16, scheme),
                              lambda x, p, kern=kern: kern.forward(x, p, None)))
        impls.append(("F.linear", "bf16", torch.bfloat16, w.to(torch.bfloat16), F.linear))
        impls.append(("F.linear", "fp32", torch.float32, w.float(), F.linear))
        for impl, quant, dtype, weights, fn in impls:
            nbytes = _nbytes(weights)
            copies = _copies(weights, nbytes)
            for m in sorted(ms or MS):
                if layer == "lm_head" and m >= 16:
                    continue  # vLLM computes logits for the last position of a prefill only
                x = torch.randn(m, k, generator=gen).to(dtype)
                # Batched decode (M up to DECODE_M_MAX) reads each layer's weights from memory
                # once per step, as M=1 does: cold copies. Prefill-sized M reuses each weight M
                # times from cache: compute-bound, so one (already warmed) copy is both fair
                # and far quicker to time.
                use = copies if m <= DECODE_M_MAX else copies[:1]
                with torch.inference_mode():
                    secs = _time(_op_calls(fn, use, x), len(use), min_time)
                row = {"model": model, "layer": layer, "m": m, "n": n, "k": k, "impl": impl,
                       "quant": quant, "group": group, "weight_bytes": nbytes,
                       "copies": len(use), "timing": "op", "seconds": secs}
                rows.append(row)
                kern = W4_KERNELS.get(impl)
                if m <= DECODE_M_MAX and hasattr(kern, "loop_seconds"):
                    # the same calls from a C++ loop (the kernel's `loop_seconds`), as our fused
                    # decoder-layer ops make them: no Python or dispatcher between calls
                    with torch.inference_mode():
                        loop = _time(lambda i, k, kern=kern, use=use, x=x:
                                     kern.loop_seconds(x, use, i, k), len(use), min_time)
                    rows.append(row | {"timing": "loop", "seconds": loop})
            del copies
    return rows


def region_cost(threads: int, reps: int = 20000, samples: int = 15) -> list[float]:
    """Microseconds to enter and leave one empty parallel region (torch's at::parallel_for,
    OpenMP here) at `threads` threads: what every kernel call pays at least once, so a decode
    step of L layers x ~7 kernel calls pays it some 7L times (called in the child)."""
    import torch

    from edge_infer.api import parallel_region_cost

    torch.set_num_threads(threads)
    parallel_region_cost(reps // 10)  # warm the pool
    return [parallel_region_cost(reps) / reps * 1e6 for _ in range(samples)]


def dot_peaks(threads: int, seconds: float = 0.2, samples: int = 7) -> dict[str, list[float]]:
    """GMAC/s of each dot instruction this CPU has (edge_infer.api.DOT_PEAK_KINDS), every
    thread issuing it back to back on registers: the arithmetic ceiling beside the streaming
    one. Past M=1 a 4-bit kernel is bound by these, not by memory (called in the child)."""
    import torch

    from edge_infer.api import DOT_PEAK_KINDS, EdgeInferError, dot_peak

    torch.set_num_threads(threads)
    out: dict[str, list[float]] = {}
    for kind, (name, macs) in DOT_PEAK_KINDS.items():
        probe = 200_000  # ~1 ms: long enough that waking the threads is not what is timed
        try:
            t = dot_peak(kind, probe)
        except (RuntimeError, EdgeInferError):  # the CPU lacks it: no record, not a zero
            continue
        iters = max(probe, int(probe * seconds / max(t, 1e-9)))
        per_round = 12 * macs * threads
        out[name] = [per_round * iters / dot_peak(kind, iters) / 1e9 for _ in range(samples)]
    return out


# -- planning side: `edge-infer bench gemm` -------------------------------------------------
def _guarded(guard, cores: list[int], what: str, label: str, fn: str):
    """`fn(threads=len(cores))` in a child pinned to `cores`, judged by the guard before and
    during: (its result, the verdict)."""
    from edge_harness.isolation.child import Worker

    verdict = guard.verdict()
    with Worker(cores, {"OMP_NUM_THREADS": str(len(cores))}, label=label) as w:
        result = guard.measure(w.pid, what, verdict, w.request, "call", fn=fn,
                               kwargs={"threads": len(cores)})["result"]
    return result, verdict


def run(models: list[str], cores: list[int], *, guard, emit, record, min_time: float = 0.3,
        ms: list[int] | None = None, kernels: list[str] | None = None, ceiling=None,
        say=print) -> None:
    """Measure every model's shapes in one pinned child; one record per (shape, M, impl,
    timing). `ceiling(guard)`, where given, measures the streaming ceiling first (and records
    it): every decode-sized record (M <= DECODE_M_MAX) then carries its GB/s as a share of
    this run's own ceiling."""
    from edge_harness.bench.run import resolve_model
    from edge_harness.isolation.child import Worker
    from edge_infer.api import default_config

    threads = len(cores)
    gbs_ceiling = ceiling(guard) if ceiling else None
    # The cost of one parallel region depends on the threads, not the model: measured once.
    for t in sorted({1, threads}):
        us, verdict = _guarded(guard, cores[:t], f"the parallel-region measurement at {t} thread(s)",
                               "parallel-region", "edge_harness.bench.gemm:region_cost")
        rec = record(engine="at::parallel_for", engine_version=_torch_version(), model="-",
                     quant="-", test="parallel_region", samples=us, unit="us", threads=t,
                     cores=cores[:t], **verdict.fields(), extra={})
        emit(rec)
        say(f"parallel region at {t} thread(s): {rec.median:.2f} us (median of {len(us)})")
        peaks, verdict = _guarded(guard, cores[:t], f"the dot-instruction peaks at {t} thread(s)",
                                  "dot-peak", "edge_harness.bench.gemm:dot_peaks")
        for instr, gmacs in peaks.items():
            short = instr.split(" (")[0].replace(" ", "-")  # e.g. vpdpbusd-zmm: the key
            rec = record(engine="dot_peak", engine_version=_torch_version(), model="-",
                         quant=short, test="dot_peak", samples=gmacs, unit="GMAC/s", threads=t,
                         cores=cores[:t], **verdict.fields(), extra={"instruction": instr})
            emit(rec)
            say(f"dot peak at {t} thread(s): {instr} {rec.median:.1f} GMAC/s")
    for name in models:
        model = resolve_model(name)
        group = default_config(model.name).group_size
        what = f"the GEMM microbenchmark of {model.name}"
        verdict = guard.verdict()
        say(f"gemm: {model.name} shapes, group {group}, {threads} threads on cores {cores}")
        with Worker(cores, {"OMP_NUM_THREADS": str(threads)}, label=f"gemm-{model.name}") as w:
            rows = guard.measure(w.pid, what, verdict, w.request, "call",
                                 fn="edge_harness.bench.gemm:measure", kwargs={
                                     "model": model.name, "hf_dir": str(model.hf_dir),
                                     "group": group, "threads": threads, "min_time": min_time,
                                     "ms": ms, "kernels": kernels}, say=say)["result"]
        for row in rows:
            flops = 2 * row["m"] * row["n"] * row["k"]
            secs = row["seconds"]
            # `gemm_`: through the op, as Python calls it; `gemmloop_`: the C++ loop of calls
            kind = "gemm" if row["timing"] == "op" else "gemmloop"
            rec = record(
                engine=row["impl"], engine_version=_torch_version(), model=model.name,
                quant=row["quant"], test=f"{kind}_m{row['m']}_{row['layer']}",
                samples=[flops / s / 1e9 for s in secs], unit="GFLOP/s", threads=threads,
                cores=cores, **verdict.fields(),
                extra={k: row[k] for k in ("m", "n", "k", "layer", "group", "weight_bytes",
                                          "copies", "timing")}
                | {"seconds": secs},
            )
            rec.achieved_gbs = round(row["weight_bytes"] / statistics.median(secs) / 1e9, 3)
            if gbs_ceiling and row["m"] <= DECODE_M_MAX:
                rec.against_ceiling(gbs_ceiling)
            emit(rec)
            say(f"{kind} {model.name} {row['layer']:<12} M={row['m']:<4} {row['impl']:<9} "
                f"{row['quant']:<6} {rec.median:8.1f} GFLOP/s {rec.achieved_gbs:7.2f} GB/s")


def _torch_version() -> str:
    import torch

    return f"torch {torch.__version__}"
