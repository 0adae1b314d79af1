"""What the hook into Keras's trainer (`keras_glue/keras_hook.py`) refuses before any
window is scheduled, on real loopback clusters: a model built outside the strategy's
scope, data of the wrong input shape, `train_on_batch`, `run_eagerly=True` and a
`steps_per_execution` other than 1 or `n_sync`; and batch callbacks run once per window.
The Keras features it honours: tests/cluster/test_keras_surface.py."""

import logging

import keras
import pytest

import tf_asgd

from helpers import build_compiled, compile_digits, digits_mlp, same_weights

N_SYNC = 10
BATCH = 32
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _strategy(cluster, **kwargs):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, **kwargs)


def test_fit_on_model_built_outside_scope(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster, n_sync=10)
    model = compile_digits(tf_asgd.models.digits_convnet())
    with strategy.scope():
        with pytest.raises(ValueError, match="created outside `AsyncParameterServerStrategy.scope"):
            model.fit(x, y, epochs=1, verbose=0)


def test_fit_on_model_built_outside_scope_and_compiled_inside(cluster, digits):
    # The compiled optimizer is the strategy's; plain Keras would train on the chief alone.
    (x, y), _ = digits
    strategy = _strategy(cluster, n_sync=10)
    model = tf_asgd.models.digits_convnet()
    with strategy.scope():
        compile_digits(model)
    with pytest.raises(ValueError, match="created outside `AsyncParameterServerStrategy.scope"):
        model.fit(x, y, epochs=1, verbose=0)
    assert strategy.stats().windows == 0


def test_dataset_shape_mismatch(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster, n_sync=10)
    with strategy.scope():
        model = compile_digits(tf_asgd.models.gem_mnist_convnet())  # expects 28x28x1
    with pytest.raises(
        ValueError, match=r"input shape \(None, 8, 8, 1\) does not match .*\(None, 28, 28, 1\)"
    ):
        model.fit(x, y, epochs=1, verbose=0)
    assert strategy.stats().windows == 0  # nothing was pushed


def test_train_on_batch_is_refused(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster, n_sync=10)
    with strategy.scope():
        model = compile_digits(tf_asgd.models.digits_convnet())
    with pytest.raises(NotImplementedError, match="use model.fit|Use model.fit"):
        model.train_on_batch(x[:32], y[:32])


# ---- compile options, on the models of tests/cluster/test_keras_surface.py -------------
# The tests below share the module's strategy. They run after the tests that make their
# own: a later strategy ends an earlier one's coordinator.


@pytest.fixture(scope="module")
def strategy(cluster):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=N_SYNC)


def _refused_before_any_window(strategy, model, x, y, match):
    windows = strategy.stats().windows
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert strategy.stats().windows == windows
    assert int(model.optimizer.iterations.numpy()) == 0
    assert same_weights(model.get_weights(), before)
    assert not strategy.model_states.get_or_create(model).fitting


def test_run_eagerly_is_refused(strategy, flat):
    (x, y), _ = flat
    model = build_compiled(strategy, digits_mlp, dict(run_eagerly=True))
    _refused_before_any_window(strategy, model, x, y, r"`run_eagerly=True`.*run_eagerly=False")


class BatchEnds(keras.callbacks.Callback):
    def __init__(self, stop_at=None):
        super().__init__()
        self.batches, self.logs, self.epoch_logs, self.stop_at = [], [], [], stop_at

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(batch)
        self.logs.append(dict(logs))
        if self.stop_at is not None and batch >= self.stop_at:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def test_steps_per_execution(strategy, flat, caplog):
    """One Keras execution is one window: batch callbacks run at the steps
    Keras's do with `steps_per_execution=n_sync`; a user's other value is
    refused; the user's value is the model's again after `fit`."""
    (x, y), _ = flat
    refused = build_compiled(strategy, digits_mlp, dict(steps_per_execution=4))
    _refused_before_any_window(
        strategy, refused, x, y, r"`steps_per_execution=4`.*n_sync=10.*`n_sync=4`"
    )

    ours, plain = [], []
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        for s, spe, out in [(strategy, 1, ours), (None, N_SYNC, plain)]:
            model = build_compiled(s, digits_mlp, dict(steps_per_execution=spe))
            ends, stops = BatchEnds(), BatchEnds(stop_at=15)
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[ends])
            assert model.steps_per_execution == spe
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[stops])
            out += [model, ends, stops, int(model.optimizer.iterations.numpy())]
    assert "BatchEnds: batch-level callback methods run once per window of n_sync=10" in (
        caplog.text
    )
    # The plain model, trained while this process is connected, is named once (of 2 fits).
    assert caplog.text.count("outside `AsyncParameterServerStrategy.scope()`: it trains") == 1
    # Keras reports its last execution's end (49 of 45 steps); the strategy the last step.
    assert plain[1].batches == [9, 19, 29, 39, 49] * 2
    assert ours[1].batches == [9, 19, 29, 39, 44] * 2
    # A stop set at batch 15 ends training after its window (steps 10 to 19).
    assert ours[2].batches == plain[2].batches == [9, 19]
    assert ours[3] == plain[3] == 90 + 20
    # Batch logs hold the windows finished so far: no made-up values before
    # the first, and the epoch's last batch sees the epoch's metrics.
    for batch_logs, epoch_logs in [
        (ours[1].logs[4], ours[1].epoch_logs[0]),
        (ours[1].logs[9], ours[1].epoch_logs[1]),
    ]:
        for key in ("loss", "accuracy"):
            assert batch_logs[key] == pytest.approx(epoch_logs[key], rel=1e-6)
    assert all(logs.get("loss", 1.0) > 0 for logs in ours[1].logs)

    same = build_compiled(strategy, digits_mlp, dict(steps_per_execution=N_SYNC))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        same.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[BatchEnds()])
    assert same.steps_per_execution == N_SYNC and "once per window" not in caplog.text
