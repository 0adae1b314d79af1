"""`add_loss` terms, regularizers and metric states under AsyncParameterServerStrategy,
against plain Keras on the same data and weights.

- A layer's `add_loss` term, `activity_regularizer` and `kernel_regularizer` are
  each counted once, as Keras counts them: in a window's local steps (Keras's
  step and a model's own `train_step`) and in evaluation on the workers.
- A metric state merges over windows and evaluation shards only if its update
  is additive (`tf_asgd.runtime.metric_states`): Keras's built-in metrics are; a
  running max is not, and is refused in training and evaluated on the chief.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.runtime.metric_states import MetricStateError

TOL = 1e-5


class ActivityPenalty(keras.layers.Layer):
    """Passes its input on and adds `rate * mean(square(input))` with `add_loss`."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def penalised_mlp(rate, regularizers=True, cls=keras.Model):
    """Digits MLP: a hidden layer whose activations carry an `add_loss` penalty
    (and, with `regularizers`, an L1 activity and an L2 kernel regularizer)."""
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(
        32,
        activation="relu",
        name="hidden",
        kernel_regularizer=keras.regularizers.L2(1e-3) if regularizers else None,
        activity_regularizer=keras.regularizers.L1(1e-3) if regularizers else None,
    )(h)
    h = ActivityPenalty(rate, name="penalty")(h)
    return cls(inputs, keras.layers.Dense(10, name="logits")(h))


class OwnTrainStep(keras.Model):
    """Keras's "Customizing what happens in fit()" recipe: `compute_loss`
    (which adds `self.losses`), then the compiled optimizer and metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _compile(model, optimizer=None, metrics=("accuracy",)):
    model.compile(
        optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def _mean_squared_activation(model, x):
    """Mean of the hidden layer's squared activations on `x` (NumPy, from the weights)."""
    kernel, bias = model.get_layer("hidden").get_weights()
    h = np.maximum(x.reshape(len(x), -1) @ kernel + bias, 0.0)
    return float(np.mean(h**2))


class RunningMax(keras.metrics.Metric):
    """The largest logit seen: a state that does not merge by addition."""

    def __init__(self, aggregation="sum", name="running_max"):
        super().__init__(name=name)
        self.top = self.add_variable((), "zeros", aggregation=aggregation, name="top")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.top.assign(keras.ops.maximum(self.top, keras.ops.max(y_pred)))

    def result(self):
        return self.top


# ---- add_loss and regularizers ------------------------------------------------


def test_add_loss_counted_in_evaluation_on_the_workers(cluster, digits, caplog):
    """The same weights give the same `evaluate` loss on the workers, on the
    chief and in plain Keras, and the add_loss term is a large part of it."""
    _, (xt, yt) = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = _compile(penalised_mlp(rate=5.0))
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        on_workers = model.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    assert "evaluating on the chief" not in caplog.text
    assert strategy.model_states.ensure_evaluator(model).last_shards  # sharded over the workers
    strategy.evaluation = "chief"
    on_chief = model.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    plain = _compile(penalised_mlp(rate=5.0))
    plain.set_weights(model.get_weights())
    in_plain = plain.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    unpenalised = _compile(penalised_mlp(rate=0.0, regularizers=False))
    unpenalised.set_weights(model.get_weights())
    ce_only = unpenalised.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    for key in in_plain:
        assert on_workers[key] == pytest.approx(in_plain[key], abs=TOL), (key, on_workers)
        assert on_chief[key] == pytest.approx(in_plain[key], abs=TOL), (key, on_chief)
    assert on_workers["loss"] - ce_only["loss"] > 0.1, (on_workers, ce_only)


@pytest.mark.parametrize("cls", [keras.Model, OwnTrainStep], ids=["keras_step", "own_train_step"])
def test_add_loss_and_regularizers_in_a_window_step_equal_plain_keras(cluster, digits, cls):
    """One window of one step from the initial weights, on a batch every
    worker holds, pushed as is: its loss and new weights are plain Keras's
    first step, add_loss term, activity and kernel regularizers included."""
    (x, y), _ = digits
    x2, y2 = np.concatenate([x[:32], x[:32]]), np.concatenate([y[:32], y[:32]])
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=1, outer_optimizer=tf_asgd.OuterSGD()
    )
    with strategy.scope():
        model = _compile(penalised_mlp(rate=5.0, cls=cls), keras.optimizers.SGD(0.5))
    plain = _compile(penalised_mlp(rate=5.0, cls=cls), keras.optimizers.SGD(0.5))
    initial = model.get_weights()
    plain.set_weights(initial)
    fit = {"batch_size": 32, "epochs": 1, "steps_per_epoch": 1, "shuffle": False, "verbose": 0}
    history = model.fit(x2, y2, **fit)
    expected = plain.fit(x2, y2, **fit)
    assert history.history["loss"][0] == pytest.approx(expected.history["loss"][0], abs=TOL)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, atol=TOL)
    # The penalties matter: plain Keras's step without them is another step.
    bare = _compile(penalised_mlp(rate=0.0, regularizers=False, cls=cls), keras.optimizers.SGD(0.5))
    bare.set_weights(initial)
    bare_history = bare.fit(x2, y2, **fit)
    assert expected.history["loss"][0] - bare_history.history["loss"][0] > 0.1
    assert np.abs(bare.get_weights()[0] - plain.get_weights()[0]).max() > 1e-3


def test_add_loss_penalty_trained_as_in_plain_keras(cluster, digits):
    """Several epochs on 2 workers: the add_loss penalty shrinks the hidden
    activations as much as in plain Keras (it did not without it), and
    held-out accuracy is within 3 points of plain Keras's."""
    (x, y), (xt, yt) = digits
    fit = {"batch_size": 32, "epochs": 4, "verbose": 0}
    plain = _compile(penalised_mlp(rate=1.0, regularizers=False))
    plain.fit(x, y, **fit)
    keras.utils.set_random_seed(0)
    without = _compile(penalised_mlp(rate=0.0, regularizers=False))
    without.fit(x, y, **fit)
    keras.utils.set_random_seed(0)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = _compile(penalised_mlp(rate=1.0, regularizers=False))
    model.fit(x, y, **fit)
    msa = {
        name: _mean_squared_activation(m, xt)
        for name, m in (("asgd", model), ("plain", plain), ("without", without))
    }
    assert msa["asgd"] < 2.0 * msa["plain"] + 0.02, msa
    assert msa["asgd"] < 0.5 * msa["without"], msa
    accuracy = {
        name: m.evaluate(xt, yt, verbose=0, return_dict=True)["accuracy"]
        for name, m in (("asgd", model), ("plain", plain))
    }
    assert accuracy["asgd"] >= accuracy["plain"] - 0.03, accuracy


# ---- metric states ------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["none", "sum", "mean", "only_first_replica"])
def test_a_running_max_is_refused_in_training(cluster, digits, aggregation):
    """Whatever its aggregation, a running max's state does not add up over
    windows: fit refuses it before any window is scheduled, naming the
    metric, its variable and what to do instead."""
    (x, y), _ = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = _compile(
            penalised_mlp(rate=0.0, regularizers=False),
            metrics=["accuracy", RunningMax(aggregation)],
        )
    why = "Maximum" if aggregation == "sum" else f"aggregation '{aggregation}'"
    with pytest.raises(MetricStateError, match=why) as raised:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    message = str(raised.value)
    for text in (
        "metric 'running_max'",
        "variable 'running_max/top'",
        "callback",
        "model.evaluate",
    ):
        assert text in message, message
    assert isinstance(raised.value, ValueError)
    assert strategy.window_log(model) == []
    assert strategy.model_stats(model).windows == 0


def test_a_running_max_is_evaluated_exactly_on_the_chief(cluster, digits, caplog):
    """Left at Keras's default aggregation ("sum"), a running max is not
    summed over shards: evaluate runs on the chief, says why once, and gives
    the true maximum, as plain Keras does."""
    _, (xt, yt) = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = _compile(penalised_mlp(rate=1.0), metrics=["accuracy", RunningMax()])
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        logs = model.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
        again = model.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    assert caplog.text.count("evaluating on the chief") == 1, caplog.text
    assert "metric variable 'running_max/top' is updated with Maximum" in caplog.text
    logits = model.predict(xt, verbose=0)
    assert logs["running_max"] == pytest.approx(float(logits.max()), abs=TOL)
    assert again == logs
    plain = _compile(penalised_mlp(rate=1.0), metrics=["accuracy", RunningMax()])
    plain.set_weights(model.get_weights())
    in_plain = plain.evaluate(xt, yt, batch_size=32, verbose=0, return_dict=True)
    for key in in_plain:
        assert logs[key] == pytest.approx(in_plain[key], abs=TOL), key


def test_builtin_metrics_train_and_merge_on_the_workers(cluster, digits, caplog):
    """AUC, Precision, Recall, F1Score, BinaryIoU and "mae" (a binary head),
    compiled as users compile them, train under windows and evaluate on the
    workers (no chief fallback) to the chief's values."""
    (x, y), (xt, yt) = digits
    yb, ybt = (y % 2 == 0).astype("float32")[:, None], (yt % 2 == 0).astype("float32")[:, None]
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            "binary_crossentropy",
            metrics=[
                "accuracy",
                "mae",
                keras.metrics.AUC(),
                keras.metrics.Precision(),
                keras.metrics.Recall(),
                keras.metrics.F1Score(threshold=0.5),
                keras.metrics.BinaryIoU(),
            ],
        )
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        history = model.fit(x, yb, batch_size=32, epochs=2, verbose=0)
        on_workers = model.evaluate(xt, ybt, verbose=0, return_dict=True)
    assert "evaluating on the chief" not in caplog.text
    assert history.history["auc"][-1] > 0.8, history.history
    strategy.evaluation = "chief"
    on_chief = model.evaluate(xt, ybt, verbose=0, return_dict=True)
    assert set(on_workers) == set(on_chief) >= {"auc", "precision", "recall", "f1_score"}
    for key in on_chief:
        assert on_workers[key] == pytest.approx(on_chief[key], abs=1e-6), key
