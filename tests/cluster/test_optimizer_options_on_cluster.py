"""Keras optimizer options and mixed precision under AsyncParameterServerStrategy:
each honoured as plain Keras honours it (compared with plain Keras on the same
data and seed), or refused before any window is scheduled."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd import internals
from tf_asgd.runtime.optimizer_options import UnsupportedFeatureError
from tf_asgd.runtime.push import device_of, raw

from ema_reference import LOSS, _assert_close, _ema_reference, _flat, _mlp, _Record


def _plain(make_optimizer, digits, **fit):
    """Held-out accuracy of plain Keras (one process) on the digits MLP."""
    (x, y), (xt, yt) = _flat(digits)
    keras.utils.set_random_seed(0)
    model = _mlp()
    model.compile(make_optimizer(), LOSS, metrics=["accuracy"])
    model.fit(x, y, verbose=0, **fit)
    return model.evaluate(xt, yt, verbose=0)[1]


def _windowed(cluster, make_optimizer, digits, n_sync=10, **fit):
    """`(held-out accuracy, model)` under the strategy, 2 workers, same seed."""
    (x, y), (xt, yt) = _flat(digits)
    keras.utils.set_random_seed(0)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=n_sync)
    with strategy.scope():
        model = _mlp()
        model.compile(make_optimizer(), LOSS, metrics=["accuracy"])
    model.fit(x, y, verbose=0, **fit)
    return model.evaluate(xt, yt, verbose=0)[1], model


# ---- EMA --------------------------------------------------------------------


def test_ema_follows_the_central_variables_at_each_push(cluster, digits):
    """One window of 5 steps per epoch (pushes one at a time): after each push
    the EMA on the PS is `0.9 ** 5 * avg + (1 - 0.9 ** 5) * central` (the first
    a copy); with `ema_overwrite_frequency=10` the central variables are the
    average after the pushes that reach steps 10, 20 and 30; `fit` ends with
    Keras's `finalize_variable_values` (the model holds the average)."""
    (x, y), _ = _flat(digits)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = _mlp()
        model.compile(
            keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=10),
            LOSS,
        )
    record = _Record(per_epoch=True)
    model.fit(x, y, batch_size=32, epochs=6, steps_per_epoch=5, verbose=0, callbacks=[record])
    averages = internals.moving_averages(model.optimizer)
    assert averages and all("/job:ps" in device_of(raw(a)) for _, a in averages)
    assert int(model.optimizer.iterations) == 30
    _assert_close(record.average[0], record.central[0])  # the first push copies
    for t in range(1, 6):
        if t % 2:  # steps 10, 20, 30: overwritten with the average
            _assert_close(record.central[t], record.average[t])
        else:
            want = _ema_reference(
                [record.central[t]], [5], 0.9, start=record.average[t - 1], before=5 * t
            )
            _assert_close(record.average[t], want[0])
            assert (
                max(np.abs(c - a).max() for c, a in zip(record.central[t], record.average[t]))
                > 1e-4
            )
    _assert_close([v.numpy() for v in model.trainable_variables], record.average[-1])


def test_ema_accuracy_matches_keras(cluster, digits):
    """Adam with `use_ema=True` (momentum 0.99), 2 workers, n_sync 10, 20
    epochs: the averaged model `fit` leaves behind is within 3 points of
    plain Keras's (it was at chance while the workers' EMA copies were
    never written back)."""

    def make():
        return keras.optimizers.Adam(1e-3, use_ema=True)

    plain = _plain(make, digits, batch_size=32, epochs=20)
    ours, _ = _windowed(cluster, make, digits, batch_size=32, epochs=20)
    print(f"held-out accuracy: plain Keras {plain:.3f}, tf_asgd {ours:.3f}")
    assert plain > 0.9 and ours > plain - 0.03, (plain, ours)


# ---- gradient accumulation --------------------------------------------------


def test_gradient_accumulation_matches_keras(cluster, digits):
    """Momentum SGD with `gradient_accumulation_steps=2` (batch 36: 40 steps
    an epoch, windows of 10): within 3 points of plain Keras, and the step
    counters mean what they mean in Keras: `iterations` counts updates
    (steps / 2), the counter schedules read counts steps."""

    def make():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)

    plain = _plain(make, digits, batch_size=36, epochs=10)
    ours, model = _windowed(cluster, make, digits, batch_size=36, epochs=10)
    print(f"held-out accuracy: plain Keras {plain:.3f}, tf_asgd {ours:.3f}")
    assert plain > 0.9 and ours > plain - 0.03, (plain, ours)
    assert int(internals.iteration_variable(model.optimizer).numpy()) == 10 * 40
    assert int(model.optimizer.iterations) == 10 * 40 // 2


@pytest.mark.parametrize("n_sync, batch_size", [(5, 36), (10, 32)], ids=["n_sync", "epoch"])
def test_gradient_accumulation_refuses_partial_cycles(cluster, digits, n_sync, batch_size):
    """Windows that are not whole accumulation cycles (n_sync 5, or an epoch
    of 45 steps) are refused before any window is scheduled."""
    (x, y), _ = _flat(digits)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=n_sync)
    with strategy.scope():
        model = _mlp()
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), LOSS)
    before = strategy.stats().windows
    with pytest.raises(UnsupportedFeatureError, match="gradient_accumulation_steps=2"):
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    assert strategy.stats().windows == before
    state = strategy.model_states.get(model)  # refused before the trainer is even built
    trainer = None if state is None else state.trainer
    assert trainer is None or not trainer.closure_sizes


# ---- clipping, loss scale factor, explicit loss scaling: exact ---------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
        lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
        lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
        lambda: keras.optimizers.SGD(0.5, loss_scale_factor=128.0),
        lambda: keras.optimizers.SGD(0.5, weight_decay=0.5),
        lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5), initial_scale=1024.0
        ),
    ],
    ids=[
        "clipnorm",
        "clipvalue",
        "global_clipnorm",
        "loss_scale_factor",
        "weight_decay",
        "loss_scale_optimizer",
    ],
)
def test_option_matches_keras_exactly(cluster, digits, make):
    """One window of 3 steps on one repeated batch, pushed as is (outer SGD
    at rate 1): the central variables equal plain Keras's after 3 steps."""
    (x, y), _ = _flat(digits)
    data = tf.data.Dataset.from_tensors((x[:64], y[:64])).repeat()
    keras.utils.set_random_seed(0)
    plain = _mlp()
    start = [v.numpy() for v in plain.weights]
    plain.compile(make(), LOSS)
    plain.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
    unclipped = _mlp()
    unclipped.set_weights(start)
    unclipped.compile(keras.optimizers.SGD(0.5), LOSS)
    unclipped.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
    # Read now: a strategy's first connection to the cluster resets the eager context.
    want = [v.numpy() for v in plain.weights]
    moved = max(np.abs(a - b.numpy()).max() for a, b in zip(want, unclipped.weights))

    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=3, outer_optimizer=tf_asgd.OuterSGD()
    )
    with strategy.scope():
        model = _mlp()
        model.set_weights(start)
        model.compile(make(), LOSS)
    model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 3
    for got, expected in zip(model.weights, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
    options = make().get_config()
    assert moved > 1e-3 or "inner_optimizer" in options or options.get("loss_scale_factor")


# ---- mixed precision --------------------------------------------------------

MIXED_EPOCHS = 15  # long enough that asynchronous timing moves held-out accuracy little


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_keras(cluster, digits, policy):
    """Under a mixed policy (float16: Keras wraps the optimizer in a
    LossScaleOptimizer) the central variables stay float32 and the model is
    within 3 points of plain Keras's; the loss scale is the workers' own."""

    def make():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _plain(make, digits, batch_size=32, epochs=MIXED_EPOCHS)
        ours, model = _windowed(cluster, make, digits, batch_size=32, epochs=MIXED_EPOCHS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"held-out accuracy: plain Keras {plain:.3f}, tf_asgd {ours:.3f}")
    assert plain > 0.9 and ours > plain - 0.03, (plain, ours)
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    steps = int(model.optimizer.iterations)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        # The PS copy of the scale is untouched: each worker keeps its own.
        assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15
        # Steps with non-finite gradients are skipped (and not counted, as in Keras).
        assert 0.9 * MIXED_EPOCHS * 45 <= steps <= MIXED_EPOCHS * 45
    else:
        assert steps == MIXED_EPOCHS * 45


# ---- refused ----------------------------------------------------------------


class OwnStep(keras.Model):
    """Keras's step written as a model's own `train_step` (the loss scaled by
    the optimizer, as Keras's own step scales it)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()

    def call(self, x, training=False):
        return self.body(x, training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self.compute_metrics(x, y, y_pred)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_in_own_train_step_matches_keras(cluster, digits, policy):
    """Under a mixed policy a model's own `train_step` (its variables read as
    casts of the window's tensors) that scales the loss and applies the
    optimizer (float16: the automatic LossScaleOptimizer) trains as under
    plain Keras: within 3 points."""
    (x, y), (xt, yt) = _flat(digits)
    float16 = policy == "mixed_float16"

    def run(strategy=None):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = OwnStep()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=MIXED_EPOCHS, verbose=0)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == float16
        return model.evaluate(xt, yt, verbose=0)[1], int(model.optimizer.iterations)

    keras.mixed_precision.set_global_policy(policy)
    try:
        plain, _ = run()
        ours, steps = run(tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"held-out accuracy: plain Keras {plain:.3f}, tf_asgd {ours:.3f}")
    assert plain > 0.9 and ours > plain - 0.03, (plain, ours)
    total = MIXED_EPOCHS * 45
    assert 0.9 * total <= steps <= total if float16 else steps == total


@pytest.mark.parametrize(
    "case",
    [
        "gem-ema",
        "gem-mixed-float16",
        "own-step-ema",
        "own-step-accumulation",
        "loss-scale-accumulation",
    ],
)
def test_refused_before_any_window(cluster, digits, case):
    """What windows cannot honour raises `UnsupportedFeatureError`, naming
    the option, at `fit`, before any window is scheduled."""
    (x, y), _ = _flat(digits)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)

    def proxy():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    make, model_class, option = {
        "gem-ema": (lambda: tf_asgd.optimizers.GEM(proxy(), use_ema=True), _mlp, "use_ema"),
        "gem-mixed-float16": (lambda: tf_asgd.optimizers.GEM(proxy()), _mlp, "mixed_float16"),
        "own-step-ema": (lambda: keras.optimizers.SGD(0.1, use_ema=True), OwnStep, "use_ema"),
        "own-step-accumulation": (
            lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=5),
            OwnStep,
            "gradient_accumulation_steps",
        ),
        "loss-scale-accumulation": (
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1, gradient_accumulation_steps=5)
            ),
            _mlp,
            "gradient_accumulation_steps` with a `LossScaleOptimizer",
        ),
    }[case]
    if case == "gem-mixed-float16":
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = model_class()
            model.compile(make(), LOSS)
        model(x[:1])
        before = strategy.stats().windows
        with pytest.raises(UnsupportedFeatureError, match=option):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert strategy.stats().windows == before


# ---- An optimizer made outside the scope ----------------------------------------------


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "rounds"])
def test_an_optimizer_made_outside_the_scope_trains(cluster, digits, synchronous):
    """`optimizer = Adam()` after the strategy but outside its scope, then `with
    strategy.scope(): model.compile(optimizer)`: Keras's TF optimizer keeps the strategy
    current at its creation (none), which plain Keras under a TF strategy refuses when it
    makes the moments. Both modes honour it as if it were made in the scope: every window
    applied, held-out accuracy as with one made in the scope."""
    (x, y), (xt, yt) = _flat(digits)
    keras.utils.set_random_seed(0)
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=5, synchronous=synchronous
    )
    accuracies = {}
    for where in ("in the scope", "outside"):
        keras.utils.set_random_seed(0)
        optimizer = keras.optimizers.Adam(1e-3)  # outside the scope
        with strategy.scope():
            model = _mlp()
            if where == "in the scope":
                optimizer = keras.optimizers.Adam(1e-3)
            model.compile(optimizer, LOSS, metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=10, verbose=0)  # to near its plateau
        stats = strategy.model_stats(model)
        assert stats.windows == stats.applied > 0, where
        accuracies[where] = model.evaluate(xt, yt, verbose=0)[1]
    assert abs(accuracies["outside"] - accuracies["in the scope"]) < 0.05, accuracies
