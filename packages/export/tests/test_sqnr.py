import math

import pytest
import torch

from edge_export.sqnr import sqnr_db


def test_hand_computed_values():
    # signal 3^2 + 4^2 = 25, noise 1^2 = 1: 10*log10(25)
    assert sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0])) == pytest.approx(
        13.9794, abs=1e-4)
    # a 10% error everywhere is 1% of the energy: 20 dB exactly
    ref = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-5)  # 1.1 is inexact in fp32
    # 100 ones vs an offset of 0.01: signal 100, noise 100 * 1e-4 = 0.01 -> 40 dB
    assert sqnr_db(torch.ones(100), torch.ones(100) + 0.01) == pytest.approx(40.0, abs=1e-4)  # fp32 0.01
    # output of zeros: noise == signal -> 0 dB
    assert sqnr_db(ref, torch.zeros_like(ref)) == pytest.approx(0.0, abs=1e-12)


def test_edges():
    ref = torch.tensor([1.0, 2.0])
    assert sqnr_db(ref, ref.clone()) == math.inf
    assert sqnr_db(ref, torch.tensor([1.0, float("nan")])) == -math.inf
    assert sqnr_db(torch.zeros(2), ref) == -math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr_db(ref, torch.ones(3))


def test_accumulates_in_float64():
    # an error of 2^-20 (exact in fp32) on a million ones: 10*log10(2^40) = 120.41 dB, which
    # fp32 sums of a million terms would blur
    ref = torch.ones(1_000_000)
    out = ref + 2.0**-20
    assert sqnr_db(ref, out) == pytest.approx(400 * math.log10(2), abs=1e-6)
