"""The default outer rule on many workers: no collapse where methods separate (MNIST-1D)."""

import keras
import numpy as np

import tf_asgd


def _held_out_curve(cluster, optimizer, n_sync=10, epochs=20, steps_per_epoch=300):
    (x, y), (x_test, y_test) = tf_asgd.data.load_mnist1d()
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=n_sync)
    with strategy.scope():
        model = tf_asgd.models.mnist1d_cnn()
        model.compile(
            optimizer(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(
        x,
        y,
        batch_size=100,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        validation_data=(x_test, y_test),
        verbose=0,
    )
    return np.array(history.history["val_accuracy"])


def test_eight_workers_with_momentum_sgd_do_not_collapse(local_cluster):
    """8 workers, n_sync 10, SGD(0.05, momentum 0.9), 2x the samples of plain
    Keras's 3000 steps of batch 100 (which reaches 0.930 to 0.933). At 1/4 a
    push (above the stability limit of 8 workers, 0.209) the same run rose
    to 0.86 and fell 17.6 points below its best; the default (the average, 1/8)
    stays inside. Its finals measured 0.891 and 0.880, so the bar (0.85) sits
    between them and a collapse's."""
    keras.utils.set_random_seed(0)
    with local_cluster(8, 1, own=True, shared_process=True) as cluster:
        curve = _held_out_curve(cluster, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    after_first_quarter = curve[len(curve) // 4 :]
    running_best = np.maximum.accumulate(curve)[len(curve) // 4 :]
    assert np.max(running_best - after_first_quarter) <= 0.05, curve
    assert curve[-1] >= 0.85, curve
