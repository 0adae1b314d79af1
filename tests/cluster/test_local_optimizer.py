"""Each worker's local optimizer counts its own steps for its own moments (Adam's bias
correction), while its schedule, `model.optimizer.iterations` and the workers' rate
factor follow the global count; each `fit` warms the factor up over its own first
steps, also from a restored step; `History` shows the rate the workers ran."""

import keras
import numpy as np
import pytest

import tf_asgd

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH = 32


def _linear(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])


@pytest.mark.parametrize(
    "make", [keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Nadam]
)
def test_each_workers_windows_are_plain_keras_on_its_own_batches(local_cluster, flat, make):
    """2 workers in synchronous rounds, the PS taking the mean of the two pushes
    (`OuterSGD(0.5)`), arrays sharded by batch: each window equals plain Keras's optimizer
    on that worker's batches from the pulled weights, to 1e-6, its moments and step count
    carried from its own previous window (round 2's steps are each worker's 6th to 10th,
    not the 11th to 15th of the global count)."""
    (x, y), _ = flat
    n_sync, rounds = 5, 2
    x, y = x[: 2 * n_sync * rounds * BATCH], y[: 2 * n_sync * rounds * BATCH]
    strategy = tf_asgd.AsyncParameterServerStrategy(
        local_cluster(2).resolver,
        n_sync=n_sync,
        synchronous=True,
        outer_optimizer=tf_asgd.OuterSGD(0.5),
    )
    with strategy.scope():
        model = _linear()
        model.compile(make(1e-2), LOSS)
    central = model.get_weights()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * n_sync * rounds

    # The reference: per worker, one plain Keras model and optimizer; worker i's batches
    # are i, i + 2, ... (arrays sharded by batch).
    batches = [
        (x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH])
        for b in range(len(x) // BATCH)
    ]
    own = [batches[i::2] for i in range(2)]
    workers = []
    for _ in range(2):
        plain = _linear()
        plain.compile(make(1e-2), LOSS)
        workers.append(plain)
    for r in range(rounds):
        updates = []
        for i, plain in enumerate(workers):
            plain.set_weights(central)
            for bx, by in own[i][r * n_sync : (r + 1) * n_sync]:
                plain.train_on_batch(bx, by)
            updates.append([w - c for w, c in zip(plain.get_weights(), central)])
        central = [c + 0.5 * (u0 + u1) for c, u0, u1 in zip(central, *updates)]
    for got, want in zip(model.get_weights(), central):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_restored_run_warms_up_and_history_shows_the_workers_rate(local_cluster, flat):
    """1 worker at a factor of 3 (5% warm-up), its optimizer's step count restored to
    10,000 before `fit` (as a checkpoint restores it): the factor rises from 1 over this
    fit's first 2 steps, as plain Keras with the ramp from step 10,000 does, step by step;
    each epoch's `workers_learning_rate` in `History` is the user's rate times the factor
    at the epoch's end, and the chief's rate stays the user's."""
    (x, y), _ = flat
    x, y = x[:320], y[:320]  # 10 steps an epoch, 4 epochs: a warm-up of 2 steps
    strategy = tf_asgd.AsyncParameterServerStrategy(
        local_cluster(1).resolver, n_sync=5, lr_scaling=3.0
    )
    with strategy.scope():
        model = _linear()
        model.compile(keras.optimizers.SGD(0.01, momentum=0.5), LOSS)
        model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(10_000)
    start = model.get_weights()
    history = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    assert history.history["workers_learning_rate"] == pytest.approx([0.03] * 4)
    stats = strategy.model_stats(model)
    assert (stats.lr_warmup_steps, stats.lr_scale_end) == (2, 3.0)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.01)

    class Ramp(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            t = keras.ops.cast(step, "float32") - 10_000.0 + 1.0
            return 0.01 * (1.0 + 2.0 * keras.ops.minimum(1.0, t / 2.0))

    plain = _linear()
    plain.set_weights(start)
    plain.compile(keras.optimizers.SGD(Ramp(), momentum=0.5), LOSS)
    plain.optimizer.build(plain.trainable_variables)
    plain.optimizer.iterations.assign(10_000)
    plain.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_learning_rate_scheduler_sets_the_rate_the_workers_scale(local_cluster, flat):
    """`LearningRateScheduler` sets the user's rate on the chief each epoch; every worker
    reads it at its next pull and runs it times the factor (3 after a 2-step warm-up): each
    step equals plain Keras at the epoch's rate times the ramped factor, and `History`
    holds both the user's rate (`learning_rate`) and the workers' (`workers_learning_rate`)."""
    (x, y), _ = flat
    x, y = x[:320], y[:320]  # 10 steps an epoch, 4 epochs

    def by_epoch(epoch, rate=None):
        return 0.02 * 0.5**epoch

    strategy = tf_asgd.AsyncParameterServerStrategy(
        local_cluster(1).resolver, n_sync=5, lr_scaling=3.0
    )
    with strategy.scope():
        model = _linear()
        model.compile(keras.optimizers.SGD(0.02, momentum=0.5), LOSS)
    start = model.get_weights()
    scheduler = keras.callbacks.LearningRateScheduler(by_epoch)
    history = model.fit(
        x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[scheduler]
    )
    rates = [by_epoch(e) for e in range(4)]
    assert history.history["learning_rate"] == pytest.approx(rates)
    assert history.history["workers_learning_rate"] == pytest.approx([3 * r for r in rates])

    class EpochRateRamped(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            t = keras.ops.cast(step, "float32")
            rate = 0.02 * keras.ops.power(0.5, keras.ops.floor(t / 10.0))
            return rate * (1.0 + 2.0 * keras.ops.minimum(1.0, (t + 1.0) / 2.0))

    plain = _linear()
    plain.set_weights(start)
    plain.compile(keras.optimizers.SGD(EpochRateRamped(), momentum=0.5), LOSS)
    plain.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
