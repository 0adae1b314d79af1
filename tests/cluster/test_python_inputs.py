"""Python-side training data (`keras.utils.PyDataset`, `Dataset.from_generator`,
`py_function` pipelines, generators) is read by the chief and sent to the
workers with each closure (`tf_asgd.runtime.python_inputs`): trained, as Keras trains
it, not refused.
"""

import multiprocessing
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.runtime import python_inputs, scheduling

from helpers import ERROR_BOUND_SECS, bounded, compile_digits

BATCH = 32
# Plain Keras on the digits convnet is at 0.97 to 0.99 after 15 epochs; the
# windows (2 workers, n_sync 10) come within a point or two of it by then.
EPOCHS = 15
POINTS = 0.03  # within 3 points of plain Keras


class DigitsPyDataset(keras.utils.PyDataset):
    """Batches of `BATCH` digits (the last one partial), recording what
    Keras (or the chief) asks of it; batch `fail_at` raises."""

    def __init__(self, x, y, fail_at=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.fail_at = x, y, fail_at
        self.events = []

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        self.events.append(i)
        if i == self.fail_at:
            raise ValueError(f"injected failure in batch {i} of the PyDataset")
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]

    def on_epoch_begin(self):
        self.events.append("begin")

    def on_epoch_end(self):
        self.events.append("end")


def _batches(x, y):
    """Every batch of the training set, the last one partial."""
    for i in range(0, len(x), BATCH):
        yield x[i : i + BATCH], y[i : i + BATCH]


SIGNATURE = (tf.TensorSpec((None, 8, 8, 1), tf.float32), tf.TensorSpec((None,), tf.int64))


@pytest.fixture(scope="module")
def strategy(cluster):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)


def _convnet(strategy=None):
    if strategy is None:
        return compile_digits(tf_asgd.models.digits_convnet())
    with strategy.scope():
        return compile_digits(tf_asgd.models.digits_convnet())


def _epochs(events):
    """The batches read between each `on_epoch_begin` and `on_epoch_end`."""
    epochs, current = [], None
    for event in events:
        if event == "begin":
            current = []
        elif event == "end":
            if current is not None:
                epochs.append(current)
            current = None
        elif current is not None:
            current.append(event)
    return epochs


def test_py_dataset_trains_like_plain_keras(strategy, digits, monkeypatch):
    (x, y), (xt, yt) = digits
    held = []  # batches the chief holds as it reads each window's
    read = python_inputs.ChiefFeed.read

    def recording(feed, window_id, num_steps):
        held.append(feed.batches_held)
        return read(feed, window_id, num_steps)

    plain_data, data = DigitsPyDataset(x, y), DigitsPyDataset(x, y)
    plain = _convnet()
    plain.fit(plain_data, epochs=EPOCHS, verbose=0)
    plain_acc = plain.evaluate(xt, yt, verbose=0)[1]

    model = _convnet(strategy)
    monkeypatch.setattr(python_inputs.ChiefFeed, "read", recording)
    history = model.fit(data, epochs=EPOCHS, verbose=0)
    acc = model.evaluate(xt, yt, verbose=0)[1]
    print(f"PyDataset: held-out {acc:.3f} under the strategy, {plain_acc:.3f} plain Keras")
    assert acc >= plain_acc - POINTS

    # Epochs as Keras makes them: one pass each (45 steps, the last batch of
    # 29), every batch read once per epoch, on_epoch_begin / on_epoch_end
    # called where plain Keras calls them.
    assert len(history.history["loss"]) == EPOCHS
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * len(data)
    assert [e for e in data.events if isinstance(e, str)] == [
        e for e in plain_data.events if isinstance(e, str)
    ]
    assert [sorted(e) for e in _epochs(data.events)] == [list(range(len(data)))] * EPOCHS
    # Memory: the batches of the closures in flight and of the one being filled, at most.
    closures = scheduling.MAX_IN_FLIGHT_PER_WORKER * strategy.num_workers + 1
    largest = max(strategy.model_states.get(model).trainer.closure_sizes) * strategy.n_sync
    print(f"the chief held at most {max(held)} batches (bound {closures * largest})")
    assert 0 < max(held) <= closures * largest


def test_py_dataset_read_by_keras_processes_trains(strategy, digits):
    """`workers` / `use_multiprocessing` are Keras's adapter's own: it reads
    the batches in 2 processes here; each epoch is one pass."""
    (x, y), (xt, yt) = digits
    before = set(threading.enumerate())
    model = _convnet(strategy)
    data = DigitsPyDataset(x, y, workers=2, use_multiprocessing=True)
    model.fit(data, epochs=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3 * len(data)
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.8
    assert _left_running(before) == []


def test_from_generator_trains_like_plain_keras(strategy, digits):
    (x, y), (xt, yt) = digits
    steps = -(-len(x) // BATCH)

    def dataset():  # repeated: plain Keras needs that with steps_per_epoch
        return tf.data.Dataset.from_generator(
            lambda: _batches(x, y), output_signature=SIGNATURE
        ).repeat()

    plain = _convnet()
    plain.fit(dataset(), epochs=EPOCHS, steps_per_epoch=steps, verbose=0)
    plain_acc = plain.evaluate(xt, yt, verbose=0)[1]

    model = _convnet(strategy)
    model.fit(dataset(), epochs=EPOCHS, steps_per_epoch=steps, verbose=0)
    acc = model.evaluate(xt, yt, verbose=0)[1]
    print(f"from_generator: held-out {acc:.3f} under the strategy, {plain_acc:.3f} plain Keras")
    assert acc >= plain_acc - POINTS
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * steps


def test_py_function_pipeline_is_read_by_the_chief(strategy, digits):
    """A pipeline that calls Python per example runs on the chief: each
    example passes through its py_function once per epoch, in this process."""
    (x, y), (xt, yt) = digits
    seen = []

    def scale(image):
        seen.append(1)  # runs in the process that reads the pipeline
        return image.numpy()

    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda a, b: (tf.ensure_shape(tf.py_function(scale, [a], tf.float32), (8, 8, 1)), b)
    )
    model = _convnet(strategy)
    model.fit(ds.batch(BATCH), epochs=3, verbose=0)
    assert len(seen) == 3 * len(x)
    assert int(model.optimizer.iterations.numpy()) == 3 * -(-len(x) // BATCH)
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.5


class SampleCount(keras.metrics.Metric):
    """Samples seen, and the sum of their labels (additive states)."""

    def __init__(self, name="samples", label_sum=False):
        super().__init__(name=name)
        self.label_sum = label_sum
        self.total = self.add_variable((), "zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        value = keras.ops.sum(y_true) if self.label_sum else keras.ops.shape(y_true)[0]
        self.total.assign(self.total + keras.ops.cast(value, "float32"))

    def result(self):
        return self.total


class Sequences(keras.utils.PyDataset):
    """Batches of sequences whose length changes from batch to batch (as with
    per-batch padding), the last batch partial; label = the sample's index + 1."""

    def __init__(self, n=100, batch=8):
        super().__init__()
        self.n, self.batch = n, batch

    def __len__(self):
        return -(-self.n // self.batch)

    def __getitem__(self, i):
        index = np.arange(i * self.batch, min((i + 1) * self.batch, self.n))
        steps = 3 + i % 4
        x = np.ones((len(index), steps, 3), "float32") * (index[:, None, None] % 5)
        return x, (index + 1).astype("float32")


def test_batches_of_every_shape_are_sent_as_they_are(strategy):
    """Neither padded nor dropped: each epoch's metric counts every sample
    once, the partial last batch included, and sums their labels exactly."""
    data = Sequences()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((None, 3)), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)]
        )
        model.compile(
            keras.optimizers.SGD(1e-3),
            "mse",
            metrics=[SampleCount(), SampleCount("label_sum", label_sum=True)],
        )
    history = model.fit(data, epochs=2, verbose=0)
    assert history.history["samples"] == [data.n] * 2
    assert history.history["label_sum"] == [data.n * (data.n + 1) / 2] * 2
    assert int(model.optimizer.iterations.numpy()) == 2 * len(data)


def _left_running(before, seconds=5.0):
    """Names of the threads started since `before`, and of child processes,
    still alive after `seconds`."""
    deadline = time.time() + seconds
    while True:
        alive = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        alive += [p.name for p in multiprocessing.active_children()]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


# Keras's own PyDataset options: read inline, by 2 threads, by 2 processes.
READERS = {
    "inline": {},
    "threads": dict(workers=2),
    "processes": dict(workers=2, use_multiprocessing=True),
}


@pytest.mark.parametrize("readers", sorted(READERS))
def test_error_in_a_py_dataset_reaches_the_user(strategy, digits, readers):
    """The PyDataset's own exception, from its third batch, within 30 s; no
    thread or process left reading; the same model then trains on arrays."""
    (x, y), (xt, yt) = digits
    model = _convnet(strategy)
    before = set(threading.enumerate())
    data = DigitsPyDataset(x, y, fail_at=2, **READERS[readers])
    _, error, secs = bounded(
        lambda: model.fit(data, epochs=2, shuffle=False, verbose=0), ERROR_BOUND_SECS
    )
    print(f"PyDataset error reached the user after {secs:.1f} s")
    assert isinstance(error, ValueError), repr(error)
    assert "injected failure in batch 2 of the PyDataset" in str(error)
    assert not strategy.model_states.get_or_create(model).fitting
    assert _left_running(before) == []

    history, error, _ = bounded(
        lambda: model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0), ERROR_BOUND_SECS * 2
    )
    assert error is None, f"the next fit failed: {error!r}"
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.5


def test_a_generator_that_runs_out_stops_training_with_keras_warning(strategy, digits):
    (x, y), _ = digits
    model = _convnet(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            _batches(x[: 12 * BATCH], y[: 12 * BATCH]), steps_per_epoch=5, epochs=4, verbose=0
        )
    assert any("ran out of data" in str(w.message) for w in caught)
    # The 12 batches it gave, in 3 epochs (5, 5, 2); then training stopped.
    assert int(model.optimizer.iterations.numpy()) == 12
    assert len(history.history["loss"]) == 3
