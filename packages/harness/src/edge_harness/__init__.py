"""edge-infer harness: isolated, llama-bench-compatible benchmarks of edge-infer vs llama.cpp.

`edge-infer bench run|load|ceiling|gemm|report`. Layout: isolation/ (physical cores, pinned
children, the lock, the contention guard, the load generator), runners/ (one adapter per
engine behind `runners.base.Runner`), bench/ (the loop, the ceiling, GEMMs, GGUF builds),
record.py (the one result record), report/ (printers and the rendered report).
"""
