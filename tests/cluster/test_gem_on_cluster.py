"""GEM: exactness against a NumPy reference written from the paper's formulas,
serialization, observability and bad input."""

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.rules import outer_optimizers

from gem_reference import (
    N_SYNC,
    ReferenceGEM,
    _tiny_model,
    _tiny_problem,
    assert_matches_reference,
    fit_recording_weights,
    gem_optimizer,
)


@pytest.mark.parametrize(
    "workers,outer",
    [
        (1, None),
        (3, None),
        (3, outer_optimizers.OuterSGD(0.5, momentum=0.9, nesterov=True)),
        (3, outer_optimizers.DelayedNesterov(0.7, 0.9, delay=2)),
    ],
)
def test_gem_matches_numpy_reference(local_cluster, workers, outer):
    cluster = local_cluster(workers)
    x, t = _tiny_problem()
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=N_SYNC, staleness="dynsgd", outer_optimizer=outer
    )
    with strategy.scope():
        model = _tiny_model()
        model.compile(gem_optimizer(), "mse")
    ref = ReferenceGEM([v.numpy() for v in model.trainable_variables], outer)
    # One window per epoch, and fit joins at each epoch's end: a fixed push
    # order; the window log says which worker ran each window.
    epochs = 12
    per_epoch = fit_recording_weights(model, x, t, epochs, steps_per_epoch=N_SYNC)
    log = strategy.window_log(model)
    assert len(log) == epochs and all(r.pushed for r in log)
    for record, weights in zip(log, per_epoch):
        ref.window(record.worker, x, t)
        assert_matches_reference(weights, ref.central)
    if workers == 3:
        assert len({r.worker for r in log}) > 1, "expected windows on several workers"
    stats = strategy.model_stats(model)
    assert stats.windows == epochs and stats.mean_staleness == 0


def test_gem_trains_digits_and_reports_pi(cluster, digits, tmp_path):
    (x, y), (xt, yt) = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10, staleness="none")
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(
            tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.05, momentum=0.9), kappa=1.0),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    # 10 epochs gave 0.969 to 0.983 (6 runs), once 0.916 in CI: GEM with kappa 1
    # starts slowly (loss 2.2, 1.8, 0.9 over the first 3 epochs), so a slow
    # schedule leaves it short. 15 gave 0.978 to 0.989 (6 runs, 2 CPU hogs beside).
    epochs = 15
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        verbose=0,
        callbacks=[tf_asgd.optimizers.gem.PiMonitor(str(tmp_path / "pi"))],
    )
    assert model.evaluate(xt, yt, verbose=0)[1] >= 0.95
    for key in ("gem_pi_mean", "gem_pi_zero", "gem_pi_max"):
        assert len(history.history[key]) == epochs
    assert all(0.0 <= p <= 5.0 for p in history.history["gem_pi_mean"])
    names, pis = tf_asgd.optimizers.gem.pi_history(model)
    assert pis.shape == (strategy.model_stats(model).applied, len(model.trainable_variables), 3)
    assert list(tmp_path.joinpath("pi").glob("events.out.tfevents.*"))

    path = tmp_path / "gem.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tf_asgd.optimizers.GEM)
    assert loaded.optimizer.kappa == 1.0 and loaded.optimizer.momentum == 0.9
    np.testing.assert_allclose(
        loaded.predict(xt, verbose=0), model.predict(xt, verbose=0), atol=1e-5
    )
