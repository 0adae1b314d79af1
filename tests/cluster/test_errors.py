"""Errors in `fit` reach the user fast and leave the strategy usable; inputs
that run Python on the chief are refused before anything runs where the
workers would have to read them (a `per_worker_dataset_fn`; otherwise the
chief reads them, tests/cluster/test_python_inputs.py).

Every test runs the failing call in a thread with a deadline (`bounded`), so
that a regression shows up as a failed test naming the hang, not as a suite
that never ends; a hard backstop (`faulthandler`) ends the process if the
hang holds the GIL (a thread's deadline cannot fire then).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd

from helpers import ERROR_BOUND_SECS, bounded, compile_digits

REFUSE_BOUND_SECS = 10  # a refused input is refused within 10 s


def _strategy(cluster, **kwargs):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5, **kwargs)


def _digits_model(strategy, *extra_layers):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                *extra_layers,
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )
        return compile_digits(model, keras.optimizers.SGD(0.05))


def assert_next_fit_works(strategy, digits):
    """A new model trains on the same strategy: its loss falls, its held-out
    accuracy is well above chance (0.1)."""
    (x, y), (xt, yt) = digits
    model = _digits_model(strategy)
    history, error, secs = bounded(
        lambda: model.fit(x, y, batch_size=32, epochs=2, verbose=0), ERROR_BOUND_SECS * 2
    )
    assert error is None, f"the next fit failed: {error!r}"
    loss = history.history["loss"]
    assert loss[-1] < loss[0]
    _, acc = model.evaluate(xt, yt, verbose=0)
    assert acc > 0.3
    return secs


class FailsOnData(keras.layers.Layer):
    """Identity, except that running it on real data raises (an error that
    only a worker's window hits: the chief's symbolic build runs no data)."""

    def call(self, x):
        check = tf.debugging.assert_less(
            tf.reduce_min(x), -1.0, message="injected failure in the model call"
        )
        with tf.control_dependencies([check]):
            return tf.identity(x)


def test_error_in_the_model_on_a_worker_reaches_the_user(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster)
    model = _digits_model(strategy, FailsOnData())
    _, error, secs = bounded(
        lambda: model.fit(x, y, batch_size=32, epochs=2, verbose=0), ERROR_BOUND_SECS
    )
    print(f"worker error reached the user after {secs:.1f} s")
    assert isinstance(error, tf.errors.InvalidArgumentError), repr(error)
    assert "injected failure in the model call" in str(error)
    assert_next_fit_works(strategy, digits)


class RaisesAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_epoch_end(self, epoch, logs=None):
        raise self.error


class RaisesAtBatchEnd(keras.callbacks.Callback):
    def __init__(self, error, batch=3):
        super().__init__()
        self.error, self.batch = error, batch

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.batch:
            raise self.error


def test_error_in_a_callback_reaches_the_user(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster)
    model = _digits_model(strategy)
    _, error, secs = bounded(
        lambda: model.fit(
            x,
            y,
            batch_size=32,
            epochs=3,
            verbose=0,
            callbacks=[RaisesAtEpochEnd(RuntimeError("injected in on_epoch_end"))],
        ),
        ERROR_BOUND_SECS,
    )
    print(f"callback error reached the user after {secs:.1f} s")
    assert isinstance(error, RuntimeError) and "injected in on_epoch_end" in str(error)
    assert not strategy.model_states.get_or_create(model).fitting
    assert_next_fit_works(strategy, digits)


def test_keyboard_interrupt_from_a_callback_reaches_the_user(cluster, digits):
    (x, y), _ = digits
    strategy = _strategy(cluster)
    model = _digits_model(strategy)
    _, error, secs = bounded(
        lambda: model.fit(
            x,
            y,
            batch_size=32,
            epochs=3,
            verbose=0,
            callbacks=[RaisesAtBatchEnd(KeyboardInterrupt())],
        ),
        ERROR_BOUND_SECS,
    )
    print(f"KeyboardInterrupt reached the user after {secs:.1f} s")
    assert isinstance(error, KeyboardInterrupt), repr(error)
    assert not strategy.model_states.get_or_create(model).fitting
    assert_next_fit_works(strategy, digits)


def test_error_in_the_input_pipeline_reaches_the_user(cluster, digits):
    (x, y), _ = digits

    def bad(image, label):
        check = tf.debugging.assert_less(
            tf.reduce_min(image), -1.0, message="injected failure in the input pipeline"
        )
        with tf.control_dependencies([check]):
            return tf.identity(image), label

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).map(bad)
    strategy = _strategy(cluster)
    model = _digits_model(strategy)
    _, error, secs = bounded(
        lambda: model.fit(ds, epochs=2, steps_per_epoch=20, verbose=0), ERROR_BOUND_SECS
    )
    print(f"input pipeline error reached the user after {secs:.1f} s")
    assert isinstance(error, tf.errors.InvalidArgumentError), repr(error)
    assert "injected failure in the input pipeline" in str(error)
    assert_next_fit_works(strategy, digits)


# ---------------------------------------------------------------------------
# Inputs that run Python on the chief, with a `per_worker_dataset_fn` (the
# workers would read them): refused before anything is scheduled


def _refused(strategy, digits, make_input, steps_per_epoch=None):
    model = _digits_model(strategy)
    data = make_input()
    kwargs = {} if steps_per_epoch is None else {"steps_per_epoch": steps_per_epoch}
    _, error, secs = bounded(
        lambda: model.fit(data, epochs=1, verbose=0, **kwargs), REFUSE_BOUND_SECS
    )
    assert isinstance(error, ValueError), repr(error)
    message = str(error)
    assert "runs Python" in message and "TFRecord" in message, message
    # Nothing ran: no window was scheduled for the refused model.
    assert (
        strategy.window_log(model) == [] and not strategy.model_states.get_or_create(model).fitting
    )
    return message, secs


def _batches(x, y, batch=32):
    for i in range(0, len(x) - batch + 1, batch):
        yield x[i : i + batch], y[i : i + batch]


@pytest.fixture(scope="module")
def shared_strategy(cluster):
    return _strategy(cluster, per_worker_dataset_fn=lambda dataset, index: dataset)


def test_from_generator_with_a_per_worker_fn_is_refused(shared_strategy, digits):
    (x, y), _ = digits
    signature = (tf.TensorSpec((None, 8, 8, 1), tf.float32), tf.TensorSpec((None,), tf.int64))
    message, secs = _refused(
        shared_strategy,
        digits,
        lambda: tf.data.Dataset.from_generator(
            lambda: _batches(x.astype("float32"), y.astype("int64")), output_signature=signature
        ),
        steps_per_epoch=10,
    )
    print(f"from_generator refused after {secs:.1f} s: {message}")
    assert "Dataset.from_generator" in message and "per_worker_dataset_fn" in message


@pytest.mark.parametrize("wrapper", ["py_function", "numpy_function"])
def test_python_function_with_a_per_worker_fn_is_refused(shared_strategy, digits, wrapper):
    (x, y), _ = digits
    op = getattr(tf, wrapper)

    def make():
        ds = tf.data.Dataset.from_tensor_slices((x.astype("float32"), y.astype("int64")))
        ds = ds.map(lambda a, b: (op(lambda v: v * 2, [a], tf.float32), b))
        return ds.map(lambda a, b: (tf.ensure_shape(a, (8, 8, 1)), b)).batch(32)

    message, _ = _refused(shared_strategy, digits, make)
    assert "py_function" in message or "numpy_function" in message
    assert "per_worker_dataset_fn" in message


class DigitsPyDataset(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 32

    def __getitem__(self, i):
        return self.x[i * 32 : (i + 1) * 32], self.y[i * 32 : (i + 1) * 32]


def test_py_dataset_with_a_per_worker_fn_is_refused(shared_strategy, digits):
    (x, y), _ = digits
    message, _ = _refused(shared_strategy, digits, lambda: DigitsPyDataset(x, y))
    assert "keras.utils.PyDataset" in message and "DigitsPyDataset" in message


def test_python_generator_with_a_per_worker_fn_is_refused(shared_strategy, digits):
    (x, y), _ = digits
    message, _ = _refused(shared_strategy, digits, lambda: _batches(x, y), steps_per_epoch=10)
    assert "Python generator" in message


def test_the_strategy_still_trains_after_refusals(shared_strategy, digits):
    assert_next_fit_works(shared_strategy, digits)


def test_tensor_pipelines_are_not_refused(shared_strategy, digits):
    """Stateful and random tensor ops (shuffle, random augmentation) are not Python."""
    (x, y), _ = digits
    ds = tf.data.Dataset.from_tensor_slices((x.astype("float32"), y))
    ds = (
        ds.shuffle(256).map(lambda a, b: (a + tf.random.uniform(tf.shape(a), 0, 0.01), b)).batch(32)
    )
    model = _digits_model(shared_strategy)
    _, error, _ = bounded(lambda: model.fit(ds, epochs=1, verbose=0), ERROR_BOUND_SECS * 2)
    assert error is None, repr(error)
    assert len(shared_strategy.window_log(model)) > 0
    assert np.isfinite(shared_strategy.window_log(model)[-1].loss)
