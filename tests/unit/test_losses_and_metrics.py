"""The rule that says whether a metric state merges over windows and evaluation shards
(`tf_asgd.runtime.metric_states`), read from the metric's update without a cluster: an
additive update merges, as Keras's built-in metrics' updates do; a running max, a moving
average, an overwrite or an update that reads another state is flagged, named with why."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.keras_glue import evaluation
from tf_asgd.runtime import metric_states, steps


class _Update(keras.metrics.Metric):
    """A one-variable metric whose update is `rule(state, batch value)`."""

    def __init__(self, rule, name):
        super().__init__(name=name)
        self.rule = rule
        self.state = self.add_variable((), "zeros", name="state")
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.rule(self, keras.ops.mean(y_pred))

    def result(self):
        return self.state


RULES = {
    "assign_add": (lambda m, x: m.state.assign_add(x), None),
    "assign_sum": (lambda m, x: m.state.assign(x + m.state), None),
    "two_adds": (lambda m, x: (m.state.assign_add(x), m.state.assign_sub(2 * x)), None),
    "max": (lambda m, x: m.state.assign(keras.ops.maximum(m.state, x)), "Maximum"),
    "moving_average": (lambda m, x: m.state.assign(0.9 * m.state + 0.1 * x), "Mul"),
    "overwrite": (lambda m, x: m.state.assign(x), "overwritten"),
    "reads_another": (
        lambda m, x: (m.count.assign_add(1.0), m.state.assign_add(x * m.count)),
        "reads a metric state",
    ),
}


def _built(metrics, y, loss="sparse_categorical_crossentropy", units=10):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(units, activation="softmax" if units > 1 else "sigmoid"),
        ]
    )
    model.compile("sgd", loss, metrics=metrics)
    x = np.random.default_rng(0).random((32, 8, 8, 1), np.float32)
    # Builds the optimizer and the metrics as a first training step does, without tracing one.
    model.optimizer.build(model.trainable_variables)
    model.compute_metrics(x, y, model(x))
    return model, x


def _found(model, x, y):
    """`metric_states.unmergeable` for Keras's step (as a window runs it) and
    for the test step (as an evaluation shard runs it)."""
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)

    def specs(vs):
        return [tf.TensorSpec(v.shape, v.dtype) for v in vs]

    batch = (
        tf.TensorSpec([None, 8, 8, 1], tf.float32),
        tf.TensorSpec([None] + list(y.shape[1:]), tf.as_dtype(y.dtype)),
    )

    def train(args, states):
        return steps.keras_step(model, model.optimizer, args[0], args[1], args[2], states)[2]

    def test(args, states):
        return evaluation._test_step_states(model, variables, args[1], args[0], states)

    return (
        metric_states.unmergeable(
            model, train, (batch, specs(variables), specs(model.optimizer.variables))
        ),
        metric_states.unmergeable(model, test, (batch, specs(variables))),
    )


@pytest.mark.parametrize("rule", sorted(RULES))
def test_additivity_is_read_from_the_update(rule):
    update, why = RULES[rule]
    y = np.arange(32) % 10
    model, x = _built(["accuracy", _Update(update, name=rule)], y)
    for found in _found(model, x, y):
        flagged = {path for _, path, _ in found}
        if why is None:
            assert found == [], found
        else:
            assert f"{rule}/state" in flagged and why in str(found), found
            assert all(name == rule for name, _, _ in found), found


def test_builtin_metrics_are_additive():
    """Keras's metrics as users compile them pass the rule, in training and
    in evaluation: sparse and one-hot labels, binary heads."""
    y = np.arange(32) % 10
    sparse, x = _built(
        [
            "accuracy",
            "sparse_categorical_accuracy",
            keras.metrics.SparseTopKCategoricalAccuracy(3),
            keras.metrics.MeanIoU(10, sparse_y_pred=False),
        ],
        y,
    )
    onehot_y = np.eye(10, dtype=np.float32)[y]
    onehot, _ = _built(
        [
            "accuracy",
            "categorical_accuracy",
            keras.metrics.F1Score(),
            keras.metrics.AUC(multi_label=True),
            keras.metrics.KLDivergence(),
            keras.metrics.OneHotMeanIoU(10),
        ],
        onehot_y,
        loss="categorical_crossentropy",
    )
    binary_y = (y % 2).astype(np.float32)[:, None]
    binary, _ = _built(
        [
            "accuracy",
            "mae",
            "mse",
            keras.metrics.AUC(),
            keras.metrics.AUC(curve="PR"),
            keras.metrics.Precision(),
            keras.metrics.Recall(),
            keras.metrics.F1Score(threshold=0.5),
            keras.metrics.PrecisionAtRecall(0.5),
            keras.metrics.BinaryIoU(),
            keras.metrics.R2Score(),
        ],
        binary_y,
        loss="binary_crossentropy",
        units=1,
    )
    for model, labels in ((sparse, y), (onehot, onehot_y), (binary, binary_y)):
        assert len(model.metrics_variables) > 6
        assert _found(model, x, labels) == ([], []), model.metrics_names
