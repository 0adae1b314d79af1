"""The noise-scale estimate against its definition, on windows with known gradient noise."""

import numpy as np
import pytest

from tf_asgd.rules import noise_scale


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("signal_scale", [0.5, 2.0])
def test_estimate_matches_tr_sigma_over_signal(workers, signal_scale):
    rng = np.random.default_rng(workers)
    dim = 50
    signal = signal_scale * rng.normal(size=dim)
    stddev = rng.uniform(0.5, 2.0, size=dim)  # anisotropic noise, known covariance
    truth = float(np.sum(stddev**2) / np.sum(signal**2))
    estimate = noise_scale.NoiseScale()
    for _ in range(3000):
        estimate.update(signal + stddev * rng.normal(size=(workers, dim)))
    assert estimate.value == pytest.approx(truth, rel=0.05)


def test_one_round_is_unbiased_for_signal_and_noise():
    rng = np.random.default_rng(0)
    signal, noise = [], []
    for _ in range(20000):
        s, n = noise_scale.round_estimates(
            *noise_scale.squared_norms(np.ones(3) + rng.normal(size=(4, 3))), 4
        )
        signal.append(s)
        noise.append(n)
    assert np.mean(signal) == pytest.approx(3.0, rel=0.03)  # |G|^2 = 3
    assert np.mean(noise) == pytest.approx(3.0, rel=0.03)  # tr(Sigma) = 3


def test_without_noise_the_scale_is_zero_and_without_signal_infinite():
    exact = noise_scale.NoiseScale()
    exact.update(np.ones((4, 5)))
    assert exact.value == pytest.approx(0.0, abs=1e-12)
    opposed = noise_scale.NoiseScale()
    opposed.update(np.array([[1.0, 0.0], [-1.0, 0.0]]))
    assert opposed.value == float("inf")
    assert np.isnan(noise_scale.NoiseScale().value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least 2 windows"):
        noise_scale.round_estimates(1.0, 1.0, 1)
    with pytest.raises(ValueError, match="decay"):
        noise_scale.NoiseScale(decay=1.0)


def test_the_sums_the_ps_keeps_give_the_mean_over_rounds():
    """`from_sums` over whole rounds (what the PS accumulates) equals the running
    mean's estimate of the same rounds, and recovers tr(Sigma) / |G|^2."""
    rng = np.random.default_rng(1)
    workers, dim = 4, 20
    running = noise_scale.NoiseScale()
    push_sq = round_sq = 0.0
    for _ in range(2000):
        windows = 0.5 + rng.normal(scale=1.5, size=(workers, dim))
        running.update(windows)
        push_sq += float(np.sum(windows**2))
        round_sq += float(np.sum(np.sum(windows, axis=0) ** 2))
    value = noise_scale.from_sums(push_sq, round_sq, workers)
    assert value == pytest.approx(running.value, rel=1e-9)
    assert value == pytest.approx(dim * 1.5**2 / (dim * 0.25), rel=0.05)  # 9 windows
    assert np.isnan(noise_scale.from_sums(0.0, 0.0, workers))


def test_workers_that_pay():
    assert noise_scale.workers_that_pay(9.3) == 9
    assert noise_scale.workers_that_pay(0.1) == 1
    assert noise_scale.workers_that_pay(float("nan")) is None


def test_the_module_examples_run():
    """The docstrings' examples are the module's own numbers (a docstring a bad edit
    broke would lose them silently)."""
    import doctest

    failures, tried = doctest.testmod(noise_scale)
    assert failures == 0 and tried >= 9
