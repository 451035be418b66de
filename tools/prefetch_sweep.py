#!/usr/bin/env python3
"""Software-prefetch sweep of our GEMV kernels on DRAM-resident weights.

Each shape is held in enough copies to span 256 MiB, and every call uses the next copy, so the
weights stream from memory as in a decode step. 2 threads, bf16 activations, group 128.
Prints weight GB/s per shape and scheme (best of 3 passes) for each prefetch distance.

    python tools/prefetch_sweep.py 0 1024 2048 4096 8192

Quiet the machine first; repeat a distance at the end to see the drift of the host.
"""

import sys
import time

import torch

from edge_infer.kernels import ext, w4a16
from edge_infer.quant.primitives import quantize_w4

SHAPES = [(4096, 1024), (6144, 1024), (1024, 3072), (13312, 2048), (2048, 6656)]


def prepare() -> dict:
    data = {}
    for n, k in SHAPES:
        q, s, z = quantize_w4(torch.randn(n, k) * 0.02, 128, False)
        packed = {sch: w4a16.EdgeAvx2.prepack(q, s, z, 128, torch.bfloat16, sch)
                  for sch in ("w4a16", "w4a8")}
        nbytes = packed["w4a16"]["q"].numel() + packed["w4a16"]["s"].numel() * 4
        copies = max(1, (256 << 20) // nbytes)
        data[(n, k)] = (nbytes, {sch: [{**p, "q": p["q"].clone(), "s": p["s"].clone()}
                                       for _ in range(copies)] for sch, p in packed.items()})
    return data


def sweep(distance: int, data: dict) -> str:
    ext.load().set_prefetch(distance)
    out = []
    for (n, k), (nbytes, by_scheme) in data.items():
        x = torch.randn(1, k).bfloat16()
        for sch, copies in by_scheme.items():
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for c in copies:
                    w4a16.EdgeAvx2.forward(x, c, None)
                best = min(best, (time.perf_counter() - t0) / len(copies))
            out.append(f"{n}x{k} {sch} {nbytes / best / 1e9:.1f}")
    return f"prefetch {distance}: " + " | ".join(out)


if __name__ == "__main__":
    torch.set_num_threads(2)
    prepared = prepare()
    for arg in sys.argv[1:] or ["0", "4096"]:
        print(sweep(int(arg), prepared), flush=True)
