"""Slow tests (a build of llama.cpp's tools): run by `nox -s fidelity-crosscheck`, which CI runs."""
