"""The workers' learning rate (`lr_scaling`): a window's steps run at the compiled
optimizer's rate times the factor, warmed up (and annealed), exactly; the chief's
optimizer keeps the user's rate; the default scales only where the PS averages the
pushes: N annealed to 1 for Adam's kin, sqrt(N) for others."""

import keras
import numpy as np
import pytest
import tensorflow.experimental.numpy as tnp

import tf_asgd
from tf_asgd.cluster import tf_config
from tf_asgd.optimizers import GEM
from tf_asgd.rules import outer_optimizers, worker_rate

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _linear(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])


class _Ramped(keras.optimizers.schedules.LearningRateSchedule):
    """The reference: `rate(step)` times the warmed-up (and annealed) factor, in plain
    Keras. Each fit of `fits`, `(first step, steps, warm-up steps)`, warms the factor
    up from 1 to `peak` over its warm-up and then (with `final`) lowers it toward
    `final` as 1/t; without `final` it stays at `peak` after the first fit's warm-up."""

    def __init__(self, rate, peak, fits, final=None):
        self.rate, self.peak, self.fits = rate, peak, fits
        self.final = final

    def __call__(self, step):
        rate = self.rate(step) if callable(self.rate) else self.rate
        factor = None
        final = self.peak if self.final is None else self.final
        for first, _, warmup in self.fits:
            this = worker_rate.annealed_rate_scale(
                self.peak, final, tnp.asarray(step, tnp.float32) - first, warmup, tnp
            )
            factor = this if factor is None else tnp.where(tnp.asarray(step) >= first, this, factor)
        return rate * factor


@pytest.mark.parametrize(
    "rate",
    [0.01, keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.8)],
    ids=["constant", "schedule"],
)
def test_one_worker_at_a_factor_equals_plain_keras_at_the_ramped_rate(local_cluster, flat, rate):
    """1 worker, the PS adding each push as is: every step of `fit` equals plain
    Keras's SGD at the user's rate times the factor, ramped over 5% of the steps."""
    (x, y), _ = flat
    x, y = x[:320], y[:320]  # 10 steps an epoch, 4 epochs: a warm-up of 2 steps
    strategy = tf_asgd.AsyncParameterServerStrategy(
        local_cluster(1).resolver, n_sync=5, lr_scaling=3.0
    )
    with strategy.scope():
        model = _linear()
        model.compile(keras.optimizers.SGD(rate, momentum=0.5), LOSS)
    start = model.get_weights()
    model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    stats = strategy.model_stats(model)
    assert (stats.lr_scale, stats.lr_warmup_steps, stats.applied) == (3.0, 2, 8)
    # What the chief and its callbacks read is the user's rate, unchanged.
    step = int(model.optimizer.iterations.numpy())
    user_rate = rate(step) if callable(rate) else rate
    np.testing.assert_allclose(float(model.optimizer.learning_rate), user_rate, rtol=1e-6)

    plain = _linear()
    plain.set_weights(start)
    plain.compile(keras.optimizers.SGD(_Ramped(rate, 3.0, [(0, 40, 2)]), momentum=0.5), LOSS)
    plain.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_annealed_factor_equals_plain_keras_at_the_annealed_rate(
    local_cluster, flat, monkeypatch
):
    """1 worker under `"anneal"`, its peak made 3 (it is N, 1 here): every step of `fit`
    equals plain Keras's Adam at the user's rate times the factor, up to 3 over the
    warm-up, then falling toward 1 as 1/t; a second fit warms up again over a quarter
    of its own steps and falls again."""
    monkeypatch.setattr(worker_rate, "worker_rate_peak", lambda n, rule: 3.0)
    (x, y), _ = flat
    x, y = x[:320], y[:320]  # 10 steps an epoch, 4 epochs: warm-up 10, x1.5 by step 40
    strategy = tf_asgd.AsyncParameterServerStrategy(
        local_cluster(1).resolver, n_sync=5, lr_scaling="anneal"
    )
    with strategy.scope():
        model = _linear()
        model.compile(keras.optimizers.Adam(0.01), LOSS)
    start = model.get_weights()
    model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    stats = strategy.model_stats(model)
    assert (stats.lr_scale_peak, stats.lr_scale) == (3.0, 1.0)
    assert (stats.lr_warmup_steps, stats.lr_scale_end) == (10, 1.5)  # a quarter; 1 + 2 * 10 / 40
    np.testing.assert_allclose(float(model.optimizer.learning_rate), 0.01, rtol=1e-6)

    plain = _linear()
    plain.set_weights(start)
    ramped = _Ramped(0.01, 3.0, [(0, 40, 10), (40, 20, 5)], final=1.0)
    plain.compile(keras.optimizers.Adam(ramped), LOSS)
    plain.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    model.fit(x[:160], y[:160], batch_size=32, epochs=4, shuffle=False, verbose=0)
    plain.fit(x[:160], y[:160], batch_size=32, epochs=4, shuffle=False, verbose=0)
    assert strategy.model_stats(model).lr_scale_end == pytest.approx(1.5)  # 1 + 2 * 5 / 20
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_default_anneals_from_n_for_adams_kin_and_scales_by_sqrt_n_for_sgd(local_cluster):
    """Where the PS averages the pushes: Adam's kin (a loss-scaling wrapper unwrapped) at
    N after the warm-up, falling to the user's rate, or staying N on a schedule; SGD and
    any other optimizer at sqrt(N)."""
    cluster = local_cluster(4)
    adam, sgd = keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.05, momentum=0.9)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    assert strategy.lr_scaling == "auto"
    assert strategy.worker_rate_scale(adam) == 1.0 and strategy.worker_rate_scale(sgd) == 2.0
    assert strategy.worker_rate_peak(adam) == 4.0 and strategy.worker_rate_peak(sgd) == 2.0
    for kin in (
        keras.optimizers.AdamW(1e-3),
        keras.optimizers.Lion(1e-4),
        keras.optimizers.RMSprop(1e-3),
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
    ):
        assert strategy.worker_rate_peak(kin) == 4.0, kin
    assert strategy.worker_rate_peak(keras.optimizers.Muon(1e-3)) == 2.0
    # On a schedule of the user's, Adam's kin keep N: the schedule lowers the rate itself.
    cosine = keras.optimizers.schedules.CosineDecay(0.0, 1000, warmup_target=1e-3, warmup_steps=100)
    for scheduled in (keras.optimizers.AdamW(cosine), keras.optimizers.Adam(cosine)):
        assert strategy.worker_rate_peak(scheduled) == strategy.worker_rate_scale(scheduled) == 4.0
    assert strategy.worker_rate_scale(keras.optimizers.SGD(cosine, momentum=0.9)) == 2.0
    # The PS's first-round rise stays where the workers' peak leaves room for it.
    outer_for = strategy._outer_optimizer_for  # private: the outer a model would get
    assert outer_for(adam) == tf_asgd.OuterSGD(0.25)
    assert outer_for(sgd) == outer_optimizers.default_outer_optimizer(4) != tf_asgd.OuterSGD(0.25)
    assert (
        strategy.worker_rate_scale(GEM(keras.optimizers.SGD(0.05, momentum=0.9))) == 1.0
    )  # GEM's steps stay the paper's
    # An outer optimizer given, or synchronous rounds: the round's gain is the PS's.
    given = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=10, outer_optimizer=tf_asgd.OuterSGD(0.25)
    )
    assert given.worker_rate_scale(adam) == given.worker_rate_peak(adam) == 1.0
    rounds = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10, synchronous=True)
    assert rounds.worker_rate_scale(adam) == rounds.worker_rate_peak(adam) == 1.0
    linear = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10, lr_scaling="linear")
    assert linear.worker_rate_scale(sgd) == 4.0
    with pytest.raises(ValueError, match="lr_scaling='linear' cannot be used with GEM"):
        linear.worker_rate_scale(GEM(keras.optimizers.SGD(0.05, momentum=0.9)))


@pytest.mark.parametrize("bad", ["quadratic", 0, -1.0, float("inf"), True])
def test_a_bad_lr_scaling_is_refused_before_connecting(bad):
    spec = {"ps": ["localhost:1"], "worker": ["localhost:2"], "chief": ["localhost:3"]}
    resolver = tf_config.make_resolver(spec)
    with pytest.raises(ValueError, match="lr_scaling must be one of"):
        tf_asgd.AsyncParameterServerStrategy(resolver, n_sync=2, lr_scaling=bad)


def test_adam_on_a_schedule_keeps_n_on_it_and_says_so(local_cluster, flat, caplog):
    """2 workers, the default, AdamW on a warm-up and cosine schedule: the factor rises to
    N over 5% of the fit and stays there (the schedule lowers the rate); `History`'s
    `workers_learning_rate` is N times the schedule at each epoch's global step, and the
    fit's log line says the factor is kept on the schedule."""
    (x, y), _ = flat
    x, y = x[:640], y[:640]  # 10 steps an epoch per worker, 20 global; 3 epochs
    strategy = tf_asgd.AsyncParameterServerStrategy(local_cluster(2).resolver, n_sync=5)
    cosine = keras.optimizers.schedules.CosineDecay(0.0, 60, warmup_target=0.01, warmup_steps=6)
    with strategy.scope():
        model = _linear()
        model.compile(keras.optimizers.AdamW(cosine), LOSS)
    with caplog.at_level("INFO", logger="tf_asgd"):
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    stats = strategy.model_stats(model)
    assert (stats.lr_scale_peak, stats.lr_scale, stats.lr_scale_end) == (2.0, 2.0, 2.0)
    assert stats.lr_warmup_steps == 3  # 5% of the fit's 60 steps
    want = [2.0 * float(cosine(t)) for t in (20, 40, 60)]  # each epoch's last global step
    np.testing.assert_allclose(history.history["workers_learning_rate"], want, atol=1e-6)
    assert caplog.text.count("kept on the optimizer's schedule") == 1
