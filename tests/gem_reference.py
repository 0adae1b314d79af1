"""GEM's NumPy reference (the paper's rule, window by window), its tiny problem, and the
fit that records the variables after each epoch to compare with it."""

import keras
import numpy as np

import tf_asgd
from tf_asgd.rules import gem_rule, staleness

LR, MU, KAPPA, N_SYNC = 0.1, 0.9, 2.0, 3


def _tiny_problem():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8, 3)).astype("float32")
    t = rng.normal(size=(8, 2)).astype("float32")
    return x, t


def _tiny_model():
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="glorot_uniform")]
    )


def _mse_grads(w, b, x, t):
    """Gradients of keras' MSE (mean over all elements) for y = x @ w + b."""
    r = x @ w + b - t
    scale = 2.0 / r.size
    return scale * x.T @ r, scale * r.sum(axis=0)


class ReferenceGEM:
    """The issue's rule in NumPy, per worker, for windows of N_SYNC plain-SGD steps."""

    def __init__(self, central, outer=None):
        self.central = [c.astype("float64") for c in central]
        self.workers = {}
        self.outer, self.outer_state, self.ticket = outer, [{} for _ in central], 0

    def window(self, worker, x, t):
        pulled = [c.copy() for c in self.central]
        w, b = pulled
        for _ in range(N_SYNC):  # local steps: plain SGD at the proxy's rate
            gw, gb = _mse_grads(w, b, x, t)
            w, b = w - LR * gw, b - LR * gb
        g = [w - pulled[0], b - pulled[1]]  # the window's accumulated update
        state = self.workers.setdefault(
            worker, {"m": [np.zeros_like(c) for c in pulled], "prev": None}
        )
        for i, c in enumerate(pulled):
            dc = c - state["prev"][i] if state["prev"] is not None else np.zeros_like(c)
            pushed, state["m"][i], _ = gem_rule.gem_step(g[i], state["m"][i], dc, MU, KAPPA)
            # tau = 0: one window at a time; the PS's outer optimizer (default: add).
            self.central[i], self.outer_state[i] = staleness.ps_push(
                self.central[i],
                pushed,
                0,
                self.ticket,
                self.outer_state[i],
                "dynsgd",
                outer=self.outer,
            )
        state["prev"] = pulled
        self.ticket += 1


class RecordWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([v.numpy() for v in self.model.trainable_variables])


def gem_optimizer():
    """GEM over momentum SGD at the reference's rate, momentum and kappa."""
    return tf_asgd.optimizers.GEM(keras.optimizers.SGD(LR, momentum=MU), kappa=KAPPA)


def fit_recording_weights(model, x, t, epochs, steps_per_epoch):
    """Fits `model` on the tiny problem, its 8 rows one batch, unshuffled.

    Args:
        model: a compiled model of `_tiny_model()`'s shape.
        x: the tiny problem's inputs.
        t: its targets.
        epochs: how many epochs.
        steps_per_epoch: steps an epoch.

    Returns:
        The trainable variables' values (NumPy) after each epoch, one list an epoch.
    """
    recorder = RecordWeights()
    model.fit(
        x,
        t,
        batch_size=8,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return recorder.weights


def assert_matches_reference(weights, central):
    """Fails unless one epoch's `weights` equal the reference's `central` variables
    (float32 training against the float64 reference)."""
    for got, want in zip(weights, central):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
