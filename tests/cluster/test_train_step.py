"""A model's own `train_step`, `compute_loss` and `test_step` under
AsyncParameterServerStrategy, on real loopback clusters."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.runtime.steps import TrainStepError


def _strategy(cluster, **kwargs):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, **kwargs)


def _flat(digits):
    (x, y), (xt, yt) = digits
    return (x.reshape(len(x), -1), y), (xt.reshape(len(xt), -1), yt)


# ---- fine-tuning: gradients applied to the head only --------------------------


class HeadOnly(keras.Model):
    """A body and a head; `train_step` applies gradients to the head only
    (Keras's "Customizing what happens in fit()" recipe, fine-tuning)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu")], name="body"
        )
        self.head = keras.Sequential([keras.Input((32,)), keras.layers.Dense(10)], name="head")

    def call(self, x, training=False):
        return self.head(self.body(x, training=training), training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.head.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.head.trainable_weights))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _compile_head_only(model):
    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_head_only_train_step_leaves_the_body_untouched(cluster, digits):
    """2 workers, n_sync 5: the body's kernels are exactly as initialised
    (as under plain Keras), the head moves and the model learns."""
    (x, y), (xt, yt) = _flat(digits)
    strategy = _strategy(cluster, n_sync=5)
    with strategy.scope():
        model = _compile_head_only(HeadOnly())
    model(x[:1])
    body0 = [v.numpy() for v in model.body.weights]
    head0 = [v.numpy() for v in model.head.weights]
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    for got, want in zip(model.body.weights, body0):
        np.testing.assert_array_equal(got.numpy(), want)
    assert all(np.abs(v.numpy() - w).max() > 1e-3 for v, w in zip(model.head.weights, head0))
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.5
    # The compiled optimizer was applied once per step.
    assert int(model.optimizer.iterations.numpy()) == 3 * int(np.ceil(len(x) / 32))
    assert strategy.model_stats(model).windows > 0

    local = _compile_head_only(HeadOnly())  # plain Keras: the same contract
    local(x[:1])
    start = [v.numpy() for v in local.body.weights]
    local.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for got, want in zip(local.body.weights, start):
        np.testing.assert_array_equal(got.numpy(), want)


# ---- a subclassed model whose `call` takes no `training` -----------------------


class NoTrainingArg(keras.Model):
    """`call(self, x)` with no `training` argument: plain Keras calls it without one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(10)

    def call(self, x):
        return self.out(self.hidden(x))


def test_a_call_without_a_training_argument_trains_on_keras_step(cluster, digits):
    """Keras's own step calls `call` without `training` where it takes none (as
    Keras's trainers do): `fit` trains, and the model learns."""
    (x, y), (xt, yt) = _flat(digits)
    strategy = _strategy(cluster, n_sync=5)
    with strategy.scope():
        model = NoTrainingArg()
        model.compile(
            keras.optimizers.Adam(1e-2),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.8


# ---- a GAN: two sub-models, two optimizers ------------------------------------

LATENT = 8


class GAN(keras.Model):
    """Keras's "GAN overriding train_step" recipe, on tiny dense nets; every
    random draw from the model's `SeedGenerator` (reproducible)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential(
            [
                keras.Input((LATENT,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(64, activation="sigmoid"),
            ],
            name="generator",
        )
        self.discriminator = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)],
            name="discriminator",
        )
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch_size = keras.ops.shape(real)[0]
        z = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        fake = self.generator(z)
        combined = keras.ops.concatenate([fake, real], axis=0)
        labels = keras.ops.concatenate(
            [keras.ops.ones((batch_size, 1)), keras.ops.zeros((batch_size, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(keras.ops.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        z = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        misleading = keras.ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(z)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def _gan():
    gan = GAN()
    gan.compile(keras.optimizers.Adam(3e-3), keras.optimizers.Adam(3e-3))
    return gan


def _weights(gan):
    return [v.numpy() for v in gan.generator.weights + gan.discriminator.weights]


def test_gan_one_worker_equals_plain_keras(local_cluster, digits):
    """One worker, windows of 1 step: both sub-models after 12 steps equal
    plain Keras's (same initial weights, same batches, same seeds), and so
    do both optimizers' step counts and the loss metrics."""
    cluster1 = local_cluster(1)
    (x, _), _ = _flat(digits)
    x = x[:96]
    strategy = _strategy(cluster1, n_sync=1)
    with strategy.scope():
        gan = _gan()
    init = _weights(gan)
    history = gan.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0)

    local = _gan()
    for v, w in zip(local.generator.weights + local.discriminator.weights, init):
        v.assign(w)
    expected = local.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(_weights(gan), _weights(local)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert max(np.abs(g - w).max() for g, w in zip(_weights(gan), init)) > 1e-3  # it trained
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)
    # The compiled optimizer (unused by train_step) did not move, as in Keras;
    # the other two counted every step, on the PS.
    assert int(gan.optimizer.iterations.numpy()) == int(local.optimizer.iterations.numpy()) == 0
    for name in ("d_optimizer", "g_optimizer"):
        assert int(getattr(gan, name).iterations.numpy()) == 12
        assert int(getattr(local, name).iterations.numpy()) == 12


def test_gan_two_workers_trains_both_sub_models(cluster, digits):
    (x, _), _ = _flat(digits)
    strategy = _strategy(cluster, n_sync=4)
    with strategy.scope():
        gan = _gan()
    gen0 = [v.numpy() for v in gan.generator.weights]
    disc0 = [v.numpy() for v in gan.discriminator.weights]
    history = gan.fit(x, batch_size=32, epochs=2, verbose=0)
    assert max(np.abs(v.numpy() - w).max() for v, w in zip(gan.generator.weights, gen0)) > 1e-3
    assert max(np.abs(v.numpy() - w).max() for v, w in zip(gan.discriminator.weights, disc0)) > 1e-3
    assert all(np.isfinite(history.history[k]).all() for k in ("d_loss", "g_loss"))
    log = strategy.window_log(gan)
    assert {r.worker for r in log} == {0, 1} and all(r.pushed for r in log)
    steps = 2 * int(np.ceil(len(x) / 32))  # both workers' steps, counted on the PS
    assert (
        int(gan.d_optimizer.iterations.numpy()) == int(gan.g_optimizer.iterations.numpy()) == steps
    )
    assert int(gan.optimizer.iterations.numpy()) == 0


# ---- Keras's own step through the model's train_step ----------------------------


class Super(keras.Sequential):
    """Overrides `train_step` only to call Keras's: the window runs it through
    `steps.ModelStep`, which must give Keras's step exactly."""

    def train_step(self, data):
        return super().train_step(data)


def _bn_net(cls):
    model = cls(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse", metrics=["mae"])
    return model


def test_train_step_calling_keras_step_equals_plain_keras(local_cluster):
    """One worker, windows of 3 steps: a model whose `train_step` is Keras's
    (through `super()`), with momentum, a metric and BatchNormalization's
    moving statistics, ends where plain Keras ends, weights and metrics."""
    cluster1 = local_cluster(1)
    rng = np.random.default_rng(5)
    x, t = rng.normal(size=(24, 3)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    strategy = _strategy(cluster1, n_sync=3)
    with strategy.scope():
        model = _bn_net(Super)
    init = model.get_weights()
    history = model.fit(x, t, batch_size=8, epochs=4, shuffle=False, verbose=0)
    local = _bn_net(Super)
    local.set_weights(init)
    expected = local.fit(x, t, batch_size=8, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 4 * 3


# ---- compute_loss and test_step overrides ---------------------------------------


class Penalised(keras.Model):
    """Keras's train_step with an overridden `compute_loss`: the compiled
    loss plus a large L2 penalty on the last kernel."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.5 * keras.ops.sum(keras.ops.square(self.layers[-1].kernel))


def _linear(cls):
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(2)(inputs))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_compute_loss_override_is_honoured(local_cluster):
    cluster1 = local_cluster(1)
    rng = np.random.default_rng(3)
    x, t = rng.normal(size=(24, 3)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    strategy = _strategy(cluster1, n_sync=3)
    results = {}
    for cls in (Penalised, keras.Model):
        with strategy.scope():
            model = _linear(cls)
        init = model.get_weights()
        model.fit(x, t, batch_size=8, epochs=3, shuffle=False, verbose=0)
        local = _linear(cls)
        local.set_weights(init)
        local.fit(x, t, batch_size=8, epochs=3, shuffle=False, verbose=0)
        for got, want in zip(model.get_weights(), local.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        results[cls] = model.get_weights()[0]
    # The penalty shrank the kernel: not the default step.
    assert np.abs(results[Penalised]).sum() < 0.8 * np.abs(results[keras.Model]).sum()


class HalfLoss(keras.Model):
    """A `test_step` that reports half the loss under its own name."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        self.half.update_state(0.5 * loss)
        return {"half_loss": self.half.result()}

    @property
    def metrics(self):
        return super().metrics + [self.half]


def _half_loss():
    inputs = keras.Input((3,))
    model = HalfLoss(inputs, keras.layers.Dense(2)(inputs))
    model.half = keras.metrics.Mean(name="half_loss")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_test_step_override_is_honoured(local_cluster):
    cluster1 = local_cluster(1)
    rng = np.random.default_rng(4)
    x, t = rng.normal(size=(24, 3)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    strategy = _strategy(cluster1, n_sync=2)
    with strategy.scope():
        model = _half_loss()
    history = model.fit(x, t, batch_size=8, epochs=2, validation_data=(x, t), verbose=0)
    assert "val_half_loss" in history.history
    got = model.evaluate(x, t, batch_size=8, verbose=0, return_dict=True)
    local = _half_loss()
    local.set_weights(model.get_weights())
    want = local.evaluate(x, t, batch_size=8, verbose=0, return_dict=True)
    # float(): Keras 3.13's evaluate returns a custom test_step's logs as tensors
    assert float(got["half_loss"]) == pytest.approx(float(want["half_loss"]), rel=1e-6)
    mse = float(np.mean((local.predict(x, verbose=0) - t) ** 2))
    assert float(got["half_loss"]) == pytest.approx(0.5 * mse, rel=1e-5)


# ---- what cannot run inside a window is refused before anything runs -----------


class Counting(HeadOnly):
    """Variants of HeadOnly whose train_step cannot run inside a window."""

    def __init__(self, variant, **kwargs):
        super().__init__(**kwargs)
        self.variant = variant
        self.calls = tf.Variable(0, trainable=False, name="calls")  # not a Keras variable
        self.hidden = keras.metrics.Mean(name="hidden")  # not listed by `metrics`

    @property
    def metrics(self):
        return [m for m in super().metrics if m is not self.hidden]

    def train_step(self, data):
        if self.variant == "numpy":
            print(data[0].numpy())
        elif self.variant == "tf_variable":
            self.calls.assign_add(1)
        elif self.variant == "tf_variable_in_cond":
            if tf.reduce_sum(data[0]) > 0:
                self.calls.assign_add(1)
        elif self.variant == "uncarried_metric":
            self.hidden.update_state(1.0)
        elif self.variant == "py_function":
            tf.py_function(lambda: None, [], [])
        return super().train_step(data)


@pytest.mark.parametrize(
    "variant,match",
    [
        ("numpy", "numpy"),
        ("tf_variable", "writes a TF variable directly"),
        ("tf_variable_in_cond", "writes a TF variable directly"),
        ("uncarried_metric", "does not carry: hidden"),
        ("py_function", "calls Python"),
        ("run_eagerly", "run_eagerly=True"),
        ("gem", "push rule"),
    ],
)
def test_train_step_that_cannot_run_in_a_window_is_refused(cluster, digits, variant, match):
    (x, y), _ = _flat(digits)
    strategy = _strategy(cluster, n_sync=5)
    with strategy.scope():
        model = Counting(variant)
        sgd = keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(
            tf_asgd.optimizers.GEM(sgd) if variant == "gem" else sgd,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=variant == "run_eagerly",
        )
    model(x[:1])
    before = [v.numpy() for v in model.weights]
    start = time.perf_counter()
    with pytest.raises(TrainStepError, match=match) as info:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert time.perf_counter() - start < 60
    assert "train_step" in str(info.value)
    for v, w in zip(model.weights, before):
        np.testing.assert_array_equal(v.numpy(), w)
    assert int(model.optimizer.iterations.numpy()) == 0
