"""The workers' rate factor as a function of the steps taken: a `fit` planned longer runs
the same factor up to any step of a shorter one (its warm-up capped at Adam's untuned
warm-up, then a 1/t fall), so planning more epochs never reaches an accuracy later."""

import keras
import numpy as np
import pytest

from tf_asgd.rules import worker_rate
from tf_asgd.runtime import optimizer_options


def _factors(fit_steps, optimizer, workers=8):
    peak = worker_rate.worker_rate_peak(workers, "anneal")
    final = worker_rate.worker_rate_scale(workers, "anneal")
    cap = worker_rate.untuned_warmup_steps(optimizer_options.second_moment_beta(optimizer))
    warmup = worker_rate.worker_rate_warmup_steps(peak, final, fit_steps, cap)
    steps = np.arange(fit_steps)
    return warmup, worker_rate.annealed_rate_scale(peak, final, steps, warmup)


@pytest.mark.parametrize("optimizer", [keras.optimizers.Adam, keras.optimizers.AdamW])
def test_a_fit_planned_twice_as_long_runs_the_same_factor_with_adams_kin(optimizer):
    warmup, short = _factors(8000, optimizer(1e-3))
    longer_warmup, longer = _factors(16000, optimizer(1e-3))
    assert warmup == longer_warmup == 2000  # 2 / (1 - 0.999)
    np.testing.assert_allclose(longer[:8000], short)
    assert short.max() == pytest.approx(8.0) and short[-1] == pytest.approx(1 + 7 / 4)
    assert np.all(np.diff(longer[2000:]) <= 0) and longer[-1] > 1.0


def test_a_short_fit_warms_up_over_its_first_quarter():
    warmup, factors = _factors(400, keras.optimizers.Adam(1e-3))
    assert warmup == 100 and factors[99] == pytest.approx(8.0)
    assert factors[0] == pytest.approx(1 + 7 / 100)


def test_without_a_second_moment_the_warm_up_is_a_quarter_of_any_fit():
    for optimizer in (keras.optimizers.Lion(1e-4), keras.optimizers.RMSprop(1e-3)):
        assert optimizer_options.second_moment_beta(optimizer) is None
        assert _factors(16000, optimizer)[0] == 4000
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3, beta_2=0.99))
    assert optimizer_options.second_moment_beta(scaled) == pytest.approx(0.99)
    assert worker_rate.untuned_warmup_steps(0.99) == 200


def test_a_constant_factor_warms_up_over_five_percent_and_stays():
    factors = worker_rate.annealed_rate_scale(2.0, 2.0, np.arange(100), 5)
    np.testing.assert_allclose(factors[:5], 1 + np.arange(1, 6) / 5)
    np.testing.assert_allclose(factors[5:], 2.0)
