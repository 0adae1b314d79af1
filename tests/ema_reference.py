"""What the optimizer-option tests share: the digits MLP they train on flattened digits, and
the parameter servers' EMA rule in NumPy with a callback that records the EMA."""

import keras
import numpy as np

from tf_asgd import internals

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _flat(digits):
    (x, y), (xt, yt) = digits
    return (x.reshape(len(x), -1), y), (xt.reshape(len(xt), -1), yt)


def _mlp():
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )


def _ema_reference(centrals, advances, momentum, start=None, before=0):
    """The PS's EMA rule in NumPy: per push of `k` steps after `before` steps,
    `m = 0` while no step was counted before it, else `momentum ** k`;
    `avg = m * avg + (1 - m) * central` (float32, Keras's order)."""
    averages, avg = [], start
    for central, k in zip(centrals, advances):
        m = np.float32(0.0 if before == 0 else np.float64(momentum) ** k)
        avg = [m * a + (np.float32(1) - m) * c for a, c in zip(avg or central, central)]
        averages.append(avg)
        before += k
    return averages


class _Record(keras.callbacks.Callback):
    """The trainable variables and the EMA after each batch (or epoch)."""

    def __init__(self, per_epoch):
        super().__init__()
        self.per_epoch, self.central, self.average = per_epoch, [], []

    def _take(self):
        self.central.append([v.numpy() for v in self.model.trainable_variables])
        self.average.append(
            [
                v.numpy()
                for _, v in internals.moving_averages(
                    internals.wrapped_optimizers(self.model.optimizer)[-1]
                )
            ]
        )

    def on_train_batch_end(self, batch, logs=None):
        if not self.per_epoch:
            self._take()

    def on_epoch_end(self, epoch, logs=None):
        if self.per_epoch:
            self._take()


def _assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
