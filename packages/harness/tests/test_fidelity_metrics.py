"""The fidelity statistics against hand-computed values (no model)."""

import math

import numpy as np
import pytest
import torch

from edge_harness.fidelity.metrics import (
    KLAccumulator,
    mean_and_uncertainty,
    per_position,
    percentile,
)
from edge_harness.fidelity.perplexity_tool import parse
from edge_infer.prompts import first_divergence


def lp(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_kl_of_identical_logits_is_zero_and_top_agrees():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    base = torch.log_softmax(logits, -1)
    kl, same, nb, nt = per_position(base, base.clone(), torch.arange(7))
    assert torch.equal(kl, torch.zeros(7, dtype=torch.float64))
    assert same.all()
    assert torch.equal(nb, nt)


def test_kl_matches_the_closed_form_of_two_point_distributions():
    p, q = 0.9, 0.6
    kl, same, nb, nt = per_position(lp([[p, 1 - p]]), lp([[q, 1 - q]]), torch.tensor([1]))
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert kl.item() == pytest.approx(expected, rel=1e-6)
    assert same.item()  # both put the most mass on token 0
    assert nb.item() == pytest.approx(-math.log(1 - p), rel=1e-6)
    assert nt.item() == pytest.approx(-math.log(1 - q), rel=1e-6)
    # KL is not symmetric: the base distribution weights the log ratio
    kl_rev, *_ = per_position(lp([[q, 1 - q]]), lp([[p, 1 - p]]), torch.tensor([0]))
    assert kl_rev.item() != pytest.approx(kl.item(), rel=1e-3)


def test_same_top_counts_disagreements():
    base = lp([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    test = lp([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.3, 0.5]])
    _, same, _, _ = per_position(base, test, torch.tensor([0, 1, 2]))
    assert same.tolist() == [True, False, True]


def test_percentiles_follow_llama_perplexity():
    values = np.arange(101, dtype=np.float64)  # sorted 0..100
    assert percentile(values, 0.99) == pytest.approx(99.0)
    assert percentile(values, 0.999) == pytest.approx(99.9)
    assert percentile(values, 0.0) == 0.0 and percentile(values, 1.0) == 100.0
    assert percentile(np.array([1.0, 3.0]), 0.25) == pytest.approx(1.5)


def test_mean_and_uncertainty_is_the_standard_error():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
    m, u = mean_and_uncertainty(x)
    assert m == pytest.approx(6.5)
    assert u == pytest.approx(x.std(ddof=0) / math.sqrt(len(x) - 1))
    assert mean_and_uncertainty(x[:5])[1] == 0.0  # llama.cpp gives no uncertainty below 11


def test_summary_ppl_and_ratio():
    acc = KLAccumulator()
    base = lp([[0.5, 0.5]] * 20)
    test = lp([[0.25, 0.75]] * 20)
    acc.add(base, test, torch.tensor([1] * 20))
    s = acc.summary()
    assert s["positions"] == 20
    assert s["ppl_base"] == pytest.approx(2.0, rel=1e-6)  # exp(-ln 0.5)
    assert s["ppl_test"] == pytest.approx(1 / 0.75, rel=1e-6)
    assert s["ppl_ratio"] == pytest.approx((1 / 0.75) / 2.0, rel=1e-6)
    expected_kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert s["kl_mean"] == pytest.approx(expected_kl, rel=1e-6)
    assert s["kl_max"] == pytest.approx(expected_kl, rel=1e-6)
    assert s["same_top_pct"] in (0.0, 100.0)  # ties at 0.5/0.5: argmax picks index 0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        per_position(lp([[0.5, 0.5]]), lp([[0.2, 0.3, 0.5]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="targets"):
        per_position(lp([[0.5, 0.5]]), lp([[0.5, 0.5]]), torch.tensor([0, 1]))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_parse_llama_perplexity_output():
    out = """====== Perplexity statistics ======
Mean PPL(Q)                   :  21.123456 ±   0.321000
Mean PPL(base)                :  20.000000 ±   0.300000
Mean PPL(Q)/PPL(base)         :   1.056173 ±   0.002000
====== KL divergence statistics ======
Mean    KLD:   0.054321 ±   0.000800
Maximum KLD:   3.210000
99.9%   KLD:   2.000000
99.0%   KLD:   0.500000
Median  KLD:   0.020000
Same top p: 91.234 ± 0.345 %
"""
    got = parse(out)
    assert got["kl_mean"] == pytest.approx(0.054321)
    assert got["same_top_pct"] == pytest.approx(91.234)
    assert got["kl_p99"] == pytest.approx(0.5)
    assert got["ppl_ratio"] == pytest.approx(1.056173)
    with pytest.raises(Exception, match="printed no"):
        parse("llama-perplexity: error: no file\n")
