"""The statistics of `llama-perplexity --kl-divergence`, from full-vocabulary log-probs.

Definitions follow llama.cpp's tools/perplexity (the vendored copy of llama-cpp-python 0.3.36):
- per scored position: KL(P_base || P_test) = sum_v p_base(v) (ln p_base(v) - ln p_test(v));
  "same top" = argmax of both agree; NLL = -ln p(next token) for each build;
- mean and its uncertainty: sqrt((E[x^2] - E[x]^2) / (n - 1)) (the standard error; llama.cpp
  prints it after "±"), and for same top p: sqrt(p (1 - p) / (n - 1));
- percentiles: linear interpolation between sorted values at fraction * (n - 1);
- PPL = exp(mean NLL); PPL ratio = exp(mean NLL_test - mean NLL_base).
Computed in float64 from float32 log-softmax rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

# (label, fraction) in the order llama-perplexity prints them
PERCENTILES = (("max", 1.0), ("p99.9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90),
               ("median", 0.5), ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0.1", 0.001),
               ("min", 0.0))


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def per_position(base_lp: torch.Tensor, test_lp: torch.Tensor, targets: torch.Tensor):
    """KL, same-top, NLL_base, NLL_test per row; *_lp are log-softmax rows [R, V]."""
    if base_lp.shape != test_lp.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(base_lp.shape)} vs {tuple(test_lp.shape)}")
    if targets.shape != base_lp.shape[:1]:
        raise ValueError(f"{targets.shape[0]} targets for {base_lp.shape[0]} rows")
    b = base_lp.double()
    t = test_lp.double()
    kl = (b.exp() * (b - t)).sum(-1)
    same = base_lp.argmax(-1) == test_lp.argmax(-1)
    idx = targets.long().view(-1, 1)
    return kl, same, -b.gather(1, idx).squeeze(1), -t.gather(1, idx).squeeze(1)


def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    m = float(x.mean())
    var = float((x * x).mean()) - m * m
    return m, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


@dataclass
class KLAccumulator:
    """Per-position values over all chunks; `summary()` gives llama-perplexity's numbers."""

    kl: list[np.ndarray] = field(default_factory=list)
    same: list[np.ndarray] = field(default_factory=list)
    nll_base: list[np.ndarray] = field(default_factory=list)
    nll_test: list[np.ndarray] = field(default_factory=list)

    def add(self, base_lp: torch.Tensor, test_lp: torch.Tensor, targets: torch.Tensor) -> None:
        kl, same, nb, nt = per_position(base_lp, test_lp, targets)
        self.kl.append(kl.numpy())
        self.same.append(same.numpy())
        self.nll_base.append(nb.numpy())
        self.nll_test.append(nt.numpy())

    def extend(self, values: dict) -> None:
        """Pool per-position values computed elsewhere (a worker's `compare` answer: lists
        under kl, same, nll_base, nll_test)."""
        self.kl.append(np.asarray(values["kl"], dtype=np.float64))
        self.same.append(np.asarray(values["same"], dtype=bool))
        self.nll_base.append(np.asarray(values["nll_base"], dtype=np.float64))
        self.nll_test.append(np.asarray(values["nll_test"], dtype=np.float64))

    @property
    def count(self) -> int:
        return sum(len(k) for k in self.kl)

    def summary(self) -> dict[str, float]:
        if not self.kl:
            raise ValueError("no positions were scored")
        kl = np.concatenate(self.kl)
        same = np.concatenate(self.same).astype(np.float64)
        nb = np.concatenate(self.nll_base)
        nt = np.concatenate(self.nll_test)
        n = len(kl)
        kl_mean, kl_sem = mean_and_uncertainty(kl)
        p = float(same.mean())
        log_ratio, log_ratio_sem = mean_and_uncertainty(nt - nb)
        out = {
            "positions": n,
            "kl_mean": kl_mean,
            "kl_sem": kl_sem,
            "kl_sd": float(kl.std(ddof=1)) if n > 1 else 0.0,
            "same_top_pct": 100.0 * p,
            "same_top_sem_pct": 100.0 * math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
            "ppl_base": math.exp(float(nb.mean())),
            "ppl_test": math.exp(float(nt.mean())),
            "ln_ppl_ratio": log_ratio,
            "ln_ppl_ratio_sem": log_ratio_sem,
            "ppl_ratio": math.exp(log_ratio),
        }
        s = np.sort(kl)
        for label, frac in PERCENTILES:
            out[f"kl_{label}"] = percentile(s, frac)
        return out
