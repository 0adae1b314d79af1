"""A `tf.data.Dataset` given to `fit` is sharded over the workers as `tf.distribute` does
(`input_sharding`): by batch where it reads no files, by file where it reads enough;
`auto_shard_policy` OFF keeps every worker reading all of it."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.runtime import input_sharding

IDS = 512  # examples, one id each
BATCH = 8


class _IdCounts(keras.metrics.Metric):
    """How often each example id was trained on: a vector state that merges over windows
    by addition."""

    def __init__(self, name="id_counts", **kwargs):
        super().__init__(name=name, **kwargs)
        self.counts = self.add_variable(shape=(IDS,), initializer="zeros", name="counts")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        self.counts.assign_add(tf.reduce_sum(tf.one_hot(ids, IDS), axis=0))

    def result(self):
        return tf.reduce_sum(self.counts)


def _ids_dataset(policy=None, seeded=True):
    keras.utils.set_random_seed(0)
    ids = np.arange(IDS)
    x = np.stack([ids, ids % 7], axis=1).astype("float32") / IDS
    dataset = tf.data.Dataset.from_tensor_slices((x, ids))
    if seeded:
        dataset = dataset.shuffle(IDS, seed=0)
    else:
        tf.random.set_seed(None)  # no global seed either: a random order on each worker
        dataset = dataset.shuffle(IDS)
    dataset = dataset.batch(BATCH)
    if policy is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        dataset = dataset.with_options(options)
    return dataset


def _id_model(strategy):
    """A linear model over the ids, with `_IdCounts` as its metric: `(model, metric)`."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(IDS)])
        metric = _IdCounts()
        model.compile(
            keras.optimizers.SGD(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[metric],
        )
    return model, metric


def _fit_one_pass(cluster, dataset, n_sync=4):
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=n_sync, synchronous=True
    )
    model, metric = _id_model(strategy)
    model.fit(dataset, epochs=1, steps_per_epoch=IDS // BATCH, verbose=0)  # one pass
    return metric.counts.numpy(), strategy


@pytest.mark.parametrize("workers", [2, 4])
def test_a_seeded_shuffled_dataset_trains_each_example_once_a_pass(local_cluster, workers, caplog):
    """Synchronous rounds (each worker one window a round, so the pass is split evenly):
    over one pass of a seeded, shuffled dataset, every example is trained on exactly once,
    so no two workers trained on the same one."""
    with caplog.at_level(logging.INFO, logger="tf_asgd"):
        counts, _ = _fit_one_pass(local_cluster(workers), _ids_dataset())
    assert counts.sum() == IDS
    np.testing.assert_array_equal(counts, np.ones(IDS))
    assert f"sharded by batch over {workers} workers (reads no files)" in caplog.text


def test_an_unseeded_shuffle_is_seeded_alike_on_every_worker(local_cluster, caplog):
    """Without any seed each worker's shuffle would draw its own order; the chief seeds
    it alike for all, so one pass still trains each example once."""
    with caplog.at_level(logging.INFO, logger="tf_asgd"):
        counts, _ = _fit_one_pass(local_cluster(2), _ids_dataset(seeded=False))
    assert "1 unseeded shuffle(s) seeded alike on every worker" in caplog.text
    np.testing.assert_array_equal(counts, np.ones(IDS))


def test_policy_off_keeps_every_worker_reading_everything(local_cluster):
    """With `auto_shard_policy` OFF each worker reads the whole seeded stream from its own
    offset (worker i skips i batches): the same pass's examples are trained twice and
    others not at all."""
    off = tf.data.experimental.AutoShardPolicy.OFF
    counts, _ = _fit_one_pass(local_cluster(2), _ids_dataset(off))
    assert counts.sum() == IDS
    assert counts.max() >= 2 and (counts == 0).sum() > 0


def _write_records(directory, files):
    paths = []
    for f in range(files):
        path = str(directory / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for k in range(IDS // files):
                writer.write(tf.io.serialize_tensor(tf.constant(f * (IDS // files) + k)).numpy())
        paths.append(path)
    return paths


def _records_dataset(paths, policy=None):
    def parse(record):
        i = tf.ensure_shape(tf.io.parse_tensor(record, tf.int32), [])
        x = tf.stack([tf.cast(i, tf.float32) / IDS, tf.cast(i % 7, tf.float32) / IDS])
        return x, tf.cast(i, tf.int64)

    dataset = tf.data.TFRecordDataset(paths).map(parse).batch(BATCH)
    if policy is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        dataset = dataset.with_options(options)
    return dataset


def test_files_are_sharded_by_file_where_there_are_enough(local_cluster, tmp_path, caplog):
    """4 TFRecord files on 2 workers: each worker reads 2 of them (FILE); every record is
    trained on once. 1 file on 2 workers: AUTO shards by batch instead, and an explicit
    FILE is refused before anything is scheduled."""
    cluster = local_cluster(2)
    with caplog.at_level(logging.INFO, logger="tf_asgd"):
        counts, _ = _fit_one_pass(cluster, _records_dataset(_write_records(tmp_path, 4)))
    assert "sharded by file over 2 workers" in caplog.text
    np.testing.assert_array_equal(counts, np.ones(IDS))

    (tmp_path / "one").mkdir()
    one = _write_records(tmp_path / "one", 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tf_asgd"):
        counts, _ = _fit_one_pass(cluster, _records_dataset(one))
    assert "reads 1 file(s), fewer than workers" in caplog.text
    np.testing.assert_array_equal(counts, np.ones(IDS))

    file_policy = tf.data.experimental.AutoShardPolicy.FILE
    with pytest.raises(ValueError, match="auto_shard_policy FILE needs at least as many"):
        _fit_one_pass(cluster, _records_dataset(one, file_policy))


def test_a_dataset_of_unknown_length_is_counted_once_for_an_epochs_steps(
    local_cluster, tmp_path, caplog, monkeypatch
):
    """TFRecord files (a length `tf.data` does not know) given to `fit` without
    `steps_per_epoch`: an epoch is one pass, as in Keras (the chief counts it once, and
    says so), and every record is trained on once. One that repeats forever behind a
    `filter` is refused within the count's bound, naming `steps_per_epoch`."""
    cluster = local_cluster(2)
    dataset = _records_dataset(_write_records(tmp_path, 4))
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=4, synchronous=True)
    model, metric = _id_model(strategy)
    with caplog.at_level(logging.INFO, logger="tf_asgd"):
        model.fit(dataset, epochs=1, verbose=0)
    assert f"found {IDS // BATCH} batches" in caplog.text
    assert int(model.optimizer.iterations.numpy()) == IDS // BATCH
    np.testing.assert_array_equal(metric.counts.numpy(), np.ones(IDS))

    monkeypatch.setattr(input_sharding, "COUNT_LIMIT_S", 1.0)
    endless = dataset.repeat().filter(lambda x, y: True)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(endless, epochs=1, verbose=0)
