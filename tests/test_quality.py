"""gkbuild.quality: KL and top-1 agreement against a direct torch computation, zero for identical
logits, a hand-made case, and the summary's worst position."""

import math

import pytest
import torch

from gkbuild import quality


def test_kl_is_torchs_kl_div_on_random_logits():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(3, 5, 1000, generator=g) * 4, torch.randn(3, 5, 1000, generator=g) * 4
    # KL(p || q) = sum p (log p - log q): kl_div(input=log q, target=log p, log_target=True)
    want = torch.nn.functional.kl_div(q.double().log_softmax(-1), p.double().log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1)
    got = quality.kl(p, q)
    assert got.dtype == torch.float64 and got.shape == (3, 5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert (got > 0).all()
    assert not torch.allclose(quality.kl(q, p), got)  # not symmetric: the original comes first


def test_identical_logits_are_zero_and_agree():
    x = torch.randn(2, 4, 300) * 30  # large logits: a naive softmax would overflow
    assert torch.equal(quality.kl(x, x), torch.zeros(2, 4, dtype=torch.float64))
    assert quality.top1(x, x).all()
    assert quality.kl(x, x + 7.0).abs().max() < 1e-12  # a shift is the same distribution


def test_a_hand_made_case():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    p = torch.tensor([[[0.0, 0.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)  # float64: log 3 exactly as math has it
    assert float(quality.kl(p, q)) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-12)
    assert quality.top1(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])).tolist() == [False]


def test_summary_names_the_worst_kept_position():
    kls = torch.tensor([[0.1, 0.5, 0.2], [0.9, 0.3, 0.0]], dtype=torch.float64)
    agree = torch.tensor([[True, False, True], [True, True, True]])
    s = quality.summary(kls, agree)
    assert s["worst"] == [1, 0] and s["max_kl"] == 0.9 and s["positions"] == 6
    assert s["mean_kl"] == pytest.approx(2.0 / 6) and s["top1_agreement"] == pytest.approx(5 / 6)
    keep = torch.tensor([[True, True, True], [False, True, True]])
    s = quality.summary(kls, agree, keep)
    assert s["worst"] == [0, 1] and s["max_kl"] == 0.5 and s["positions"] == 5
    assert s["p99_kl"] == pytest.approx(float(torch.quantile(kls[keep], 0.99)))
    assert quality.summary(kls, agree, torch.zeros_like(keep))["mean_kl"] is None


def test_section_keeps_the_build_to_its_judged_positions():
    g = torch.Generator().manual_seed(1)
    orig = torch.randn(2, 3, 50, generator=g)
    keep = torch.tensor([[False, True, True], [False, True, True]])
    s = quality.section(orig, orig + 0.1 * torch.randn(2, 3, 50, generator=g), orig, keep)
    assert s["reference"]["mean_kl"] > 0 and s["reference"]["positions"] == 6
    assert s["build"]["mean_kl"] == 0 and s["build"]["positions"] == 4
    assert math.isnan(s["build"]["kl"][0][0]) and s["build"]["kl"][0][1] == 0
