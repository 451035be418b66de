"""Measurements: the benchmark plan and loop, the bandwidth ceiling, the GEMM microbenchmark."""
