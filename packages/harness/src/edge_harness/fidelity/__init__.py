"""Fidelity of a build against its own engine's full-precision build: greedy reproductions and
the statistics `llama-perplexity --kl-divergence` prints, from full-vocabulary logits."""
