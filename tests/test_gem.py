"""GEM: exactness against a NumPy reference written from the paper's formulas,
serialization, observability and bad input."""

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.rules import update_rules

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
            pushed, state["m"][i], _ = update_rules.gem_step(g[i], state["m"][i], dc, MU, KAPPA)
            # tau = 0: one window at a time; the PS's outer optimizer (default: add).
            self.central[i], self.outer_state[i] = update_rules.ps_push(
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


@pytest.mark.cluster  # the cluster fixture is looked up by name, so conftest cannot see it
@pytest.mark.parametrize(
    "cluster_name,outer",
    [
        ("cluster1", None),
        ("cluster3", None),
        ("cluster3", update_rules.OuterSGD(0.5, momentum=0.9, nesterov=True)),
        ("cluster3", update_rules.DelayedNesterov(0.7, 0.9, delay=2)),
    ],
)
def test_gem_matches_numpy_reference(request, cluster_name, outer):
    cluster = request.getfixturevalue(cluster_name)
    x, t = _tiny_problem()
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=N_SYNC, staleness="dynsgd", outer_optimizer=outer
    )
    with strategy.scope():
        model = _tiny_model()
        model.compile(
            tf_asgd.optimizers.GEM(keras.optimizers.SGD(LR, momentum=MU), kappa=KAPPA), "mse"
        )
    ref = ReferenceGEM([v.numpy() for v in model.trainable_variables], outer)
    recorder = RecordWeights()
    # One window per epoch, and fit joins at each epoch's end: a fixed push
    # order; the window log says which worker ran each window.
    epochs = 12
    model.fit(
        x,
        t,
        batch_size=8,
        epochs=epochs,
        steps_per_epoch=N_SYNC,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    log = strategy.window_log(model)
    assert len(log) == epochs and all(r.pushed for r in log)
    for record, weights in zip(log, recorder.weights):
        ref.window(record.worker, x, t)
        for got, want in zip(weights, ref.central):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    if cluster_name == "cluster3":
        assert len({r.worker for r in log}) > 1, "expected windows on several workers"
    stats = strategy.model_stats(model)
    assert stats.windows == epochs and stats.mean_staleness == 0


def test_single_process_gem_is_the_paper_rule():
    """Outside a cluster GEM is an ordinary optimizer: one worker, n_sync = 1."""
    x, t = _tiny_problem()
    model = _tiny_model()
    model.compile(tf_asgd.optimizers.GEM(keras.optimizers.SGD(LR, momentum=MU), kappa=KAPPA), "mse")
    w, b = (v.numpy().astype("float64") for v in model.trainable_variables)
    m, prev = [np.zeros_like(w), np.zeros_like(b)], None
    model.fit(x, t, batch_size=8, epochs=10, shuffle=False, verbose=0)
    for _ in range(10):
        gw, gb = _mse_grads(w, b, x, t)
        out = []
        for i, (c, g) in enumerate([(w, -LR * gw), (b, -LR * gb)]):
            dc = c - prev[i] if prev is not None else np.zeros_like(c)
            pushed, m[i], _ = update_rules.gem_step(g, m[i], dc, MU, KAPPA)
            out.append(c + pushed)
        prev = [w, b]
        w, b = out
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), b, rtol=2e-5, atol=2e-6)


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


def test_gem_config_round_trip_with_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5)
    opt = tf_asgd.optimizers.GEM(
        keras.optimizers.SGD(schedule, momentum=0.8), kappa=1.5, pi_max=3.0
    )
    again = tf_asgd.optimizers.GEM.from_config(opt.get_config())
    assert (again.kappa, again.pi_max, again.momentum) == (1.5, 3.0, 0.8)
    assert isinstance(again.inner._learning_rate, keras.optimizers.schedules.ExponentialDecay)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, tf_asgd.optimizers.GEM)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1)), "momentum > 0"),
        (lambda: tf_asgd.optimizers.GEM(keras.optimizers.Adam()), "momentum > 0"),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)),
            "nesterov",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), kappa=0),
            "kappa must be a finite number > 0",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), kappa=-1),
            "kappa",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(
                keras.optimizers.SGD(0.1, momentum=0.9), pi_max=float("inf")
            ),
            "pi_max",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), pi_max=0),
            "pi_max",
        ),
        (lambda: tf_asgd.optimizers.GEM("sgd"), "wraps a Keras optimizer"),
    ],
)
def test_gem_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()
