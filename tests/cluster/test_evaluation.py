"""Evaluation on the workers: `evaluate` and `fit`'s
validation sharded over the workers give the chief's metrics, exactly."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd

from helpers import ROOT, compile_digits

TOL = 1e-6


def _model(strategy, digits, epochs=1):
    """A fixed model: the digits convnet, seeded, trained briefly (so that
    its predictions are neither uniform nor perfect)."""
    (x, y), _ = digits
    with strategy.scope():
        model = compile_digits(tf_asgd.models.digits_convnet())
    model.fit(x, y, batch_size=32, epochs=epochs, steps_per_epoch=20, verbose=0)
    return model


def _both(strategy, model, *args, **kwargs):
    """`model.evaluate(...)` as a dict, on the workers and on the chief."""
    strategy.evaluation = "workers"
    evaluator = strategy.model_states.ensure_evaluator(model)
    evaluator.last_shards = []
    on_workers = model.evaluate(*args, verbose=0, return_dict=True, **kwargs)
    shards = evaluator.last_shards
    strategy.evaluation = "chief"
    try:
        on_chief = model.evaluate(*args, verbose=0, return_dict=True, **kwargs)
    finally:
        strategy.evaluation = "workers"
    return on_workers, on_chief, shards


def _assert_same(on_workers, on_chief):
    assert set(on_workers) == set(on_chief) >= {"loss", "accuracy"}
    for key in on_chief:
        assert abs(on_workers[key] - on_chief[key]) <= TOL, (key, on_workers, on_chief)


def _assert_exact_cover(shards, num_batches, num_workers):
    """Every batch in exactly one shard, in more shards than workers."""
    assert shards, "evaluate ran on the chief, not on the workers"
    covered = [b for start, count in shards for b in range(start, start + count)]
    assert sorted(covered) == list(range(num_batches))
    assert len(shards) > num_workers


def test_arrays_on_the_workers_equal_the_chief(cluster, digits, caplog):
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    model = _model(strategy, digits)
    _, (xt, yt) = digits
    x, y = xt[:357], yt[:357]  # 357 = 11 * 32 + 5: odd, and a last partial batch
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        on_workers, on_chief, shards = _both(strategy, model, x, y, batch_size=32)
    assert "evaluating on the chief" not in caplog.text
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 12, strategy.num_workers)
    assert 0.2 < on_chief["accuracy"] < 1.0  # a model whose metrics say something

    # Sample-weighted, another batch size; and the list form of the result.
    weights = np.random.default_rng(0).uniform(0.0, 2.0, len(x)).astype("float32")
    on_workers, on_chief, shards = _both(
        strategy, model, x, y, sample_weight=weights, batch_size=50
    )
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 8, strategy.num_workers)
    listed = model.evaluate(x, y, batch_size=50, sample_weight=weights, verbose=0)
    np.testing.assert_allclose(listed, [on_chief["loss"], on_chief["accuracy"]], atol=TOL)

    # `steps` stops after that many batches, as Keras does.
    on_workers, on_chief, shards = _both(strategy, model, x, y, batch_size=32, steps=5)
    _assert_same(on_workers, on_chief)
    assert sum(c for _, c in shards) == 5

    # One trace per batch size serves every shard, the last partial batch
    # included, and every later evaluate (fit's validation each epoch).
    functions = strategy.model_states.ensure_evaluator(model)._functions
    assert len(functions) == 2  # batch sizes 32 and 50
    assert all(f.experimental_get_tracing_count() == 1 for f in functions.values())


def test_finite_dataset_on_the_workers_equals_the_chief(cluster, digits):
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    model = _model(strategy, digits)
    _, (xt, yt) = digits
    ds = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(24)  # 360 = 15 * 24
    on_workers, on_chief, shards = _both(strategy, model, ds)
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 15, strategy.num_workers)

    # Sample weights in the dataset, a last partial batch, and a map on the worker.
    weights = np.linspace(0.0, 1.0, len(xt)).astype("float32")
    ds = (
        tf.data.Dataset.from_tensor_slices((xt, yt, weights))
        .map(lambda a, b, w: (a * 1.0, b, w))
        .batch(32)
    )  # 11 batches of 32 and one of 8
    on_workers, on_chief, shards = _both(strategy, model, ds)
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 12, strategy.num_workers)

    # Unknown length (a filter) with `steps`: fewer than the data, or more
    # (the shards past the end read nothing, as Keras stops at the end).
    unknown = ds.filter(lambda a, b, w: True)
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    for steps in (5, 100):
        on_workers, on_chief, _ = _both(strategy, model, unknown, steps=steps)
        _assert_same(on_workers, on_chief)


def test_fit_validation_on_the_workers_equals_chief_evaluation(cluster, digits):
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    assert strategy.evaluation == "workers"  # the default
    (x, y), (xt, yt) = digits
    with strategy.scope():
        model = compile_digits(tf_asgd.models.digits_convnet())
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        steps_per_epoch=20,
        verbose=0,
        validation_data=(xt[:357], yt[:357]),
    )
    assert len(strategy.model_states.ensure_evaluator(model).last_shards) > strategy.num_workers
    strategy.evaluation = "chief"
    on_chief = model.evaluate(xt[:357], yt[:357], batch_size=32, verbose=0, return_dict=True)
    assert abs(history.history["val_loss"][-1] - on_chief["loss"]) <= TOL
    assert abs(history.history["val_accuracy"][-1] - on_chief["accuracy"]) <= TOL
    # The training metrics of the epoch are the windows', not the validation's.
    assert history.history["loss"][-1] != history.history["val_loss"][-1]

    # validation_split: the last 20% of the arrays, evaluated with fit's batch size.
    strategy.evaluation = "workers"
    history = model.fit(
        x, y, batch_size=32, epochs=1, steps_per_epoch=10, verbose=0, validation_split=0.2
    )
    split = int(len(x) * 0.8)
    strategy.evaluation = "chief"
    on_chief = model.evaluate(x[split:], y[split:], batch_size=32, verbose=0, return_dict=True)
    assert abs(history.history["val_loss"][-1] - on_chief["loss"]) <= TOL
    assert abs(history.history["val_accuracy"][-1] - on_chief["accuracy"]) <= TOL

    # Compiled again with other metrics: nothing traced for the old compile is reused.
    with strategy.scope():
        model.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(3)],
        )
    on_workers, on_chief, shards = _both(strategy, model, xt, yt, batch_size=32)
    assert "sparse_top_k_categorical_accuracy" in on_chief
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 12, strategy.num_workers)


def test_a_models_own_test_step_runs_on_the_chief_with_a_log_line(cluster, digits, caplog):
    class HalfLoss(keras.Sequential):
        def test_step(self, data):
            logs = super().test_step(data)
            return {"half_loss": logs["loss"] / 2}

    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = compile_digits(HalfLoss(tf_asgd.models.digits_convnet().layers))
    _, (xt, yt) = digits
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        logs = model.evaluate(xt, yt, verbose=0, return_dict=True)
        model.evaluate(xt, yt, verbose=0, return_dict=True)
    assert set(logs) == {"half_loss"}
    assert caplog.text.count("overrides test_step") == 1


class MaxLogit(keras.metrics.Metric):
    """A metric whose state (a running max) does not merge by addition; it
    says so with `aggregation="none"`."""

    def __init__(self):
        super().__init__(name="max_logit")
        self.top = self.add_variable(shape=(), initializer="zeros", aggregation="none", name="top")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.top.assign(keras.ops.maximum(self.top, keras.ops.max(y_pred)))

    def result(self):
        return self.top


def test_a_metric_that_does_not_add_runs_on_the_chief_with_a_log_line(cluster, digits, caplog):
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", MaxLogit()],
        )
    _, (xt, yt) = digits
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        logs = model.evaluate(xt, yt, verbose=0, return_dict=True)
    assert "metric variable 'max_logit/top' has aggregation 'none'" in caplog.text
    logits = model.predict(xt, verbose=0)
    assert logs["max_logit"] == pytest.approx(float(logits.max()), abs=1e-5)


def test_empty_evaluation_data_returns_nothing_as_plain_keras(cluster, digits):
    # Plain Keras: `evaluate` on no batch returns `[]`; empty validation data is skipped.
    (x, y), _ = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = compile_digits(tf_asgd.models.digits_convnet())
    assert model.evaluate(x[:0], y[:0], verbose=0) == []
    history = model.fit(
        x, y, batch_size=32, steps_per_epoch=20, validation_data=(x[:0], y[:0]), verbose=0
    )
    assert set(history.history) >= {"loss", "accuracy"}
    assert not any(k.startswith("val_") for k in history.history), history.history
    assert model.evaluate(x[:0], y[:0], verbose=0) == []


def test_bad_evaluation_argument_is_refused(cluster):
    with pytest.raises(ValueError, match="evaluation must be 'workers'.*or 'chief'.*'gpu'"):
        tf_asgd.AsyncParameterServerStrategy(cluster.resolver, evaluation="gpu")
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver)
    with pytest.raises(ValueError, match="evaluation must be"):
        strategy.evaluation = None
    assert strategy.evaluation == "workers"


# TF's executor of the killed worker's connection complains when it is freed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_worker_killed_during_evaluation_changes_nothing(local_cluster, digits):
    """Shards are read-only closures: the coordinator re-runs a dead
    worker's shard on a live one, and each shard still counts once."""
    _, (xt, yt) = digits
    with local_cluster(2, 1, own=True, shared_process=False) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
        with strategy.scope():
            model = compile_digits(tf_asgd.models.digits_convnet())
        # 100 ms per batch (tf.data sleep, on whichever task reads the data):
        # 23 batches in 4 shards take a few seconds on the workers.
        slow = (
            tf.data.Dataset.from_tensor_slices((xt, yt))
            .batch(16)
            .apply(tf_asgd.data.sleep_transformation(100_000))
        )
        fast = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(16)
        model.evaluate(fast, verbose=0)  # traced, the model built
        events = {}

        def kill():
            time.sleep(0.8)
            events["killed"] = time.perf_counter()
            cluster.kill_task("worker:1", signal.SIGKILL)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        on_workers = model.evaluate(slow, verbose=0, return_dict=True)
        events["done"] = time.perf_counter()
        killer.join(10)
        assert events["killed"] < events["done"], "the worker was killed after evaluate returned"
        _assert_exact_cover(strategy.model_states.ensure_evaluator(model).last_shards, 23, 2)
        cluster.restart_task("worker:1")
        strategy.evaluation = "chief"
        on_chief = model.evaluate(fast, verbose=0, return_dict=True)
        _assert_same(on_workers, on_chief)


def _lookup_model(strategy):
    """Digits as words: each pixel's level (0 to 16) a string, looked up by a
    `StringLookup` (a hash table) inside the model."""
    with strategy.scope():
        words = keras.Input((64,), dtype="string")
        levels = keras.layers.StringLookup(vocabulary=[str(i) for i in range(17)])(words)
        hidden = keras.layers.Embedding(19, 4)(levels)
        logits = keras.layers.Dense(10)(keras.layers.Flatten()(hidden))
        return compile_digits(keras.Model(words, logits))


def _as_words(x):
    return np.round(x.reshape(len(x), -1) * 16).astype(int).astype(str)


def test_a_model_with_a_lookup_table_is_evaluated_on_the_workers(cluster, digits, caplog):
    """The table is the worker's own copy (the strategy's per-worker table)."""
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    model = _lookup_model(strategy)
    (x, y), (xt, yt) = digits
    train = tf.data.Dataset.from_tensor_slices((_as_words(x), y)).batch(32)
    val = tf.data.Dataset.from_tensor_slices((_as_words(xt), yt)).batch(24)
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        history = model.fit(train, epochs=2, verbose=0, validation_data=val)
        on_workers, on_chief, shards = _both(strategy, model, val)
    assert "evaluating on the chief" not in caplog.text
    _assert_same(on_workers, on_chief)
    _assert_exact_cover(shards, 15, strategy.num_workers)
    assert abs(history.history["val_loss"][-1] - on_chief["loss"]) <= TOL
    assert abs(history.history["val_accuracy"][-1] - on_chief["accuracy"]) <= TOL
    assert on_chief["accuracy"] > 0.5  # trained: the lookup gave the workers real inputs


# Datasets built before the cluster and the strategy, as scripts usually start: the
# chief's devices are renamed when it connects (`/job:localhost` -> `/job:chief`), which
# only a process that has never connected shows, so it runs in a fresh one.
_BUILT_BEFORE = """
import json, os, tempfile
import keras, numpy as np, tensorflow as tf
import tf_asgd

(x, y), (xt, yt) = tf_asgd.data.load_digits()


def data():
    def batches():
        for i in range(0, len(xt), 24):
            yield xt[i : i + 24], yt[i : i + 24]

    spec = (tf.TensorSpec([None, 8, 8, 1]), tf.TensorSpec([None], tf.int64))
    return (
        tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=0).batch(32),
        tf.data.Dataset.from_tensor_slices((xt, yt)).batch(24),
        tf.data.Dataset.from_tensor_slices(xt).batch(24),
        tf.data.Dataset.from_generator(batches, output_signature=spec),
    )


train, val, images, generated = data()
words = keras.layers.StringLookup()  # adapted at the top of the script, as Keras's guides do
words.adapt(np.round(x.reshape(len(x), -1) * 16).astype(int).astype(str))
auc = keras.metrics.AUC(name="auc")  # a metric object made at the top of the script
adam = keras.optimizers.Adam(1e-3)  # an optimizer made at the top of the script
with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    _, val_now, images_now, _ = data()  # the same data built now, for Keras's own loop

    def reference():
        strategy.evaluation = "chief"
        result = model.evaluate(val_now, verbose=0), model.predict(images_now, verbose=0)
        strategy.evaluation = "workers"
        return result[0], result[1].tolist()

    out = {}
    history = model.fit(train, epochs=2, steps_per_epoch=20, validation_data=val, verbose=0)
    out["val"] = [history.history["val_loss"][-1], history.history["val_accuracy"][-1]]
    out["evaluate"] = model.evaluate(val, verbose=0)
    out["shards"] = len(strategy.model_states.ensure_evaluator(model).last_shards)
    out["predict"] = model.predict(images, verbose=0).tolist()
    out["reference"] = reference()
    out["generated"] = model.evaluate(generated, verbose=0)  # read by the chief
    model.fit(generated.repeat(), epochs=1, steps_per_epoch=10, verbose=0)
    out["generated_after_fit"] = model.evaluate(generated, verbose=0)
    out["predict_generated"] = model.predict(generated.map(lambda a, b: a), verbose=0).tolist()
    out["reference_after_fit"] = reference()
    path = os.path.join(tempfile.mkdtemp(), "loaded.keras")
    model.save(path)  # a plain Keras model (not the strategy's) meets them too
    loaded = keras.models.load_model(path)
    out["loaded"] = [loaded.evaluate(val, verbose=0), loaded.evaluate(val_now, verbose=0)]
    with strategy.scope():
        inputs = keras.Input((64,), dtype="string")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(words(inputs)))
        stale = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        stale.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    strings = np.round(x.reshape(len(x), -1) * 16).astype(int).astype(str)
    try:
        stale.fit(strings, y, epochs=1, steps_per_epoch=5, verbose=0)
    except ValueError as e:
        out["stale_table"] = str(e)
    with strategy.scope():
        early = tf_asgd.models.digits_convnet()
        early.compile("sgd", keras.losses.CategoricalCrossentropy(from_logits=True), metrics=[auc])
    try:
        early.fit(x, keras.utils.to_categorical(y, 10), epochs=1, steps_per_epoch=5, verbose=0)
    except ValueError as e:
        out["stale_metric"] = str(e)
    with strategy.scope():
        late = tf_asgd.models.digits_convnet()
        late.compile(adam, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pushes = int(strategy.counters.version.numpy())
    try:
        late.fit(x, y, epochs=1, steps_per_epoch=5, verbose=0)
    except ValueError as e:
        out["stale_optimizer"] = str(e)
    out["stale_optimizer_pushes"] = int(strategy.counters.version.numpy()) - pushes
print("RESULT " + json.dumps(out))
"""


def test_datasets_built_before_the_strategy_are_read_on_the_chief(tmp_path):
    script = tmp_path / "built_before.py"
    script.write_text(_BUILT_BEFORE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["shards"] > 2  # evaluated on the workers
    evaluated, predicted = out["reference"]
    np.testing.assert_allclose(out["val"], evaluated, atol=TOL)
    np.testing.assert_allclose(out["evaluate"], evaluated, atol=TOL)
    np.testing.assert_allclose(out["predict"], predicted, atol=TOL)
    np.testing.assert_allclose(out["generated"], evaluated, atol=TOL)
    evaluated, predicted = out["reference_after_fit"]
    assert evaluated != out["reference"][0]  # the fit on the generator's data trained
    np.testing.assert_allclose(out["generated_after_fit"], evaluated, atol=TOL)
    np.testing.assert_allclose(out["predict_generated"], predicted, atol=TOL)
    np.testing.assert_allclose(*out["loaded"], atol=TOL)
    # A lookup table adapted before the strategy is refused before any window (each
    # would fail with "unknown device" on the workers, which TF retried without end).
    assert "made before the strategy connected" in out.get("stale_table", ""), out
    # So is a metric object made before it, naming its variable (reading it failed with
    # TF's "Client for target /job:localhost ... not found").
    assert "'auc/true_positives' was made before" in out.get("stale_metric", ""), out
    # And an optimizer made before it (its step counter on `/job:localhost`).
    assert "optimizer (Adam) made before the strategy" in out.get("stale_optimizer", ""), out
    assert out["stale_optimizer_pushes"] == 0  # refused before any window
