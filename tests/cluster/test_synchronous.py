"""Synchronous mode (`synchronous=True`): rounds of N windows from one start, one outer step
each, against a NumPy reference; staleness 0; exactly once with a worker killed mid-round;
what it refuses."""

import signal
import threading
import time

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.rules import noise_scale, outer_optimizers
from tf_asgd.runtime import rounds

WORKERS, N_SYNC, BATCH, LR = 2, 5, 8, 0.05
BATCHES = 7  # batches in the data set: each worker's stream wraps around it


def _data(seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCHES * BATCH, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.3).astype(np.float32)
    y += 0.1 * rng.normal(size=y.shape).astype(np.float32)
    return x, y


def _linear(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse")
    return model


def _window(theta, batches):
    """Plain SGD on the mean squared error of a linear model, from `theta`
    over `batches`; returns the window's displacement."""
    w, b = theta[0].copy(), theta[1].copy()
    for xb, yb in batches:
        err = xb @ w + b - yb
        w -= LR * (2.0 / len(xb)) * xb.T @ err
        b -= LR * (2.0 / len(xb)) * err.sum(axis=0)
    return [w - theta[0], b - theta[1]]


def _reference(init, log, x, y, opt, workers, restarted=None, displacements=None):
    """The central weights after the rounds of `log` in NumPy: each round's
    windows from the same start, worker `i` reading its shard of the data
    set repeated (`fit` shards it by batch: batches `i, i + workers, ...`), each push
    through `outer_optimizers.outer_step` by its ticket. `restarted`: `(worker,
    index in log)`: that worker was restarted before the record at that
    index, and its data stream starts again there. `displacements`: a list
    that gets each round's windows' displacements, flat, in round order."""
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    batches = [(a.astype(np.float64), b.astype(np.float64)) for a, b in batches]
    theta = [v.astype(np.float64) for v in init]
    state = [{}, {}]
    position = {w: 0 for w in range(workers)}  # batches each worker has read
    ticket = 0
    by_round = {}
    for k, record in enumerate(log):  # in the order seen: each worker's in the order it ran them
        by_round.setdefault(record.window_id // workers, []).append((k, record))
    for r in sorted(by_round):
        start = [t.copy() for t in theta]
        for k, record in by_round[r]:
            if restarted and record.worker == restarted[0] and k >= restarted[1]:
                position[record.worker], restarted = 0, None  # a new iterator
            steps = record.samples // BATCH
            w, read = record.worker, position[record.worker]
            taken = [batches[(w + workers * (read + j)) % BATCHES] for j in range(steps)]
            position[record.worker] += steps
            update = _window(start, taken)
            if displacements is not None:
                if len(displacements) <= r:
                    displacements.append([])
                displacements[r].append(np.concatenate([u.ravel() for u in update]))
            for i in range(2):
                theta[i], state[i] = outer_optimizers.outer_step(
                    opt, theta[i], -update[i], state[i], ticket, workers
                )
            ticket += 1
    return theta


@pytest.mark.parametrize(
    "outer_optimizer",
    [outer_optimizers.OuterSGD(1.0 / WORKERS), outer_optimizers.DelayedNesterov(0.7, 0.9)],
    ids=repr,
)
def test_rounds_follow_the_numpy_mean_of_windows(cluster, outer_optimizer):
    """2 workers, rounds of 2 windows of 5 steps: the central weights are each round's
    windows from one start, their mean applied by the outer optimizer (plain
    averaging, and one delayed-Nesterov step per round), as NumPy computes them;
    every push has staleness 0 and every round's pushes start from one version."""
    import tensorflow as tf

    x, y = _data()
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=N_SYNC, synchronous=True, outer_optimizer=outer_optimizer
    )
    model = _linear(strategy)
    init = [np.asarray(v) for v in model.get_weights()]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    rounds_run = 6  # 3 epochs of 2 rounds
    model.fit(dataset, epochs=3, steps_per_epoch=2 * WORKERS * N_SYNC, verbose=0)
    log = strategy.window_log(model)
    stats = strategy.model_stats(model)
    assert len(log) == rounds_run * WORKERS == stats.windows == stats.applied
    assert sorted(r.window_id for r in log) == list(range(rounds_run * WORKERS))
    assert all(r.pushed and not r.replayed and r.staleness == 0 for r in log)
    assert stats.max_staleness == 0 and stats.mean_staleness == 0.0
    assert all(r.samples == N_SYNC * BATCH for r in log)
    windows = []
    expected = _reference(init, log, x, y, outer_optimizer, WORKERS, displacements=windows)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if isinstance(outer_optimizer, outer_optimizers.DelayedNesterov):
        # The noise scale of the last epoch's 2 rounds, from the PS's sums, is the
        # NumPy one: the pushes' squared norms and their rounds' sums.
        last = np.asarray(windows[-2:])  # rounds x windows x parameters
        push_sq = float(np.sum(last**2))
        round_sq = float(np.sum(np.sum(last, axis=1) ** 2))
        want = noise_scale.from_sums(push_sq, round_sq, WORKERS)
        assert stats.noise_scale_rounds == 2 and np.isfinite(want)
        assert stats.noise_scale == pytest.approx(want, rel=1e-3)
        assert "noise scale" in repr(stats)
    else:  # no round buffer: not measured
        assert stats.noise_scale_rounds == 0 and np.isnan(stats.noise_scale)


def test_an_epoch_that_is_not_whole_rounds_ends_with_shorter_windows(cluster):
    """An epoch of 11 steps on 2 workers with n_sync 5: a round of 2 x 5 steps, then its
    last step and an empty window (it pushes zeros); still the NumPy reference, and the
    default outer optimizer is the synchronous one."""
    import tensorflow as tf

    x, y = _data(seed=4)
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=N_SYNC, synchronous=True
    )
    model = _linear(strategy)
    init = [np.asarray(v) for v in model.get_weights()]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(dataset, epochs=2, steps_per_epoch=11, verbose=0)
    log = strategy.window_log(model)
    assert sorted(r.samples // BATCH for r in log) == sorted([5, 5, 1, 0] * 2)
    assert int(model.optimizer.iterations.numpy()) == 22
    assert strategy.model_stats(model).windows == 8
    assert all(r.staleness == 0 for r in log)
    opt = strategy.model_states.get(model).trainer.outer
    assert opt == outer_optimizers.default_synchronous_outer_optimizer(WORKERS)
    expected = _reference(init, log, x, y, opt, WORKERS)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("hang_guard")
def test_a_worker_killed_mid_round_leaves_every_window_applied_once(local_cluster):
    """Worker 0 is killed while a round runs (windows slowed to 60 ms a step) and
    restarted: its window runs again (on the other worker or on it once back), each
    round still applies exactly its 2 windows, never one twice, all at staleness 0."""
    import tensorflow as tf

    x, y = _data()
    steps, epochs = 4 * WORKERS * N_SYNC, 1
    with local_cluster(WORKERS, 1, own=True, shared_process=False) as own:
        strategy = tf_asgd.AsyncParameterServerStrategy(
            own.resolver,
            n_sync=N_SYNC,
            synchronous=True,
            per_worker_dataset_fn=tf_asgd.data.emulated_device_time(60),
        )
        model = _linear(strategy)
        init = [np.asarray(v) for v in model.get_weights()]
        events = {}

        def inject():
            try:
                deadline = time.time() + 120
                while len(strategy.window_log(model)) < WORKERS and time.time() < deadline:
                    time.sleep(0.01)
                time.sleep(0.1)  # inside the second round's windows (300 ms each)
                own.kill_task("worker:0", signal.SIGKILL)
                events["killed"] = len(strategy.window_log(model))
                time.sleep(1.0)
                own.restart_task("worker:0")
                events["restarted"] = True
            except BaseException as e:  # reported by the main thread
                events["error"] = e

        helper = threading.Thread(target=inject, daemon=True)
        helper.start()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0)
        helper.join(120)
        assert "error" not in events, events.get("error")
        assert "killed" in events and events.get("restarted"), events
        log = strategy.window_log(model)
        stats = strategy.model_stats(model)
        windows = steps // N_SYNC
        ids = [r.window_id for r in log]
        print(f"killed after {events['killed']} windows; workers {[r.worker for r in log]}")
        assert sorted(ids) == list(range(windows))  # each window recorded once
        assert stats.windows == stats.applied == windows  # one ticket each
        assert int(strategy.counters.version.numpy()) == windows
        assert int(model.optimizer.iterations.numpy()) == steps
        assert all(r.pushed and r.staleness == 0 for r in log)
        assert stats.max_staleness == 0
        # The window lost with worker 0 ran again from its round's start.
        opt = outer_optimizers.default_synchronous_outer_optimizer(WORKERS)
        expected = _reference(init, log, x, y, opt, WORKERS, restarted=(0, events["killed"]))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_synchronous_refuses_what_rounds_cannot_honour():
    """Each refused combination raises a ValueError naming `synchronous=True` and the
    option, before anything connects."""
    ok = dict(
        synchronous=True,
        staleness="none",
        max_staleness=None,
        windows_per_closure=None,
        outer_opt=None,
        n=2,
    )
    rounds.validate_synchronous(**ok)
    rounds.validate_synchronous(**dict(ok, windows_per_closure=1))
    rounds.validate_synchronous(**dict(ok, outer_opt=outer_optimizers.OuterSGD(0.5)))
    rounds.validate_synchronous(**dict(ok, outer_opt=outer_optimizers.DelayedNesterov(0.7, 0.9)))
    rounds.validate_synchronous(**dict(ok, outer_opt=outer_optimizers.DelayedNesterov(delay=2)))
    rounds.validate_synchronous(**dict(ok, synchronous=False, staleness="dynsgd", n=3))
    refused = {
        "staleness='dynsgd'": dict(staleness="dynsgd"),
        "max_staleness=3": dict(max_staleness=3),
        "windows_per_closure=4": dict(windows_per_closure=4),
        "momentum": dict(outer_opt=outer_optimizers.OuterSGD(0.7, momentum=0.9)),
        "schedule": dict(outer_opt=outer_optimizers.OuterSGD(0.5, schedule=((4, 0.25),))),
        "delay None or 2": dict(outer_opt=outer_optimizers.DelayedNesterov(delay=3)),
    }
    for words, change in refused.items():
        with pytest.raises(ValueError, match="synchronous=True") as info:
            rounds.validate_synchronous(**dict(ok, **change))
        assert words in str(info.value)
    with pytest.raises(ValueError, match="synchronous must be True or False"):
        rounds.validate_synchronous(**dict(ok, synchronous="yes"))
    with pytest.raises(ValueError, match="synchronous=True cannot be combined with a GEM"):
        rounds.refuse_push_rule(object())
    rounds.refuse_push_rule(None)


def test_the_strategy_refuses_before_connecting_and_gem_before_any_window(cluster, flat):
    """The strategy checks its options before it connects; a GEM optimizer is refused
    when `fit` builds the trainer, before any window is scheduled."""
    with pytest.raises(ValueError, match="max_staleness"):
        tf_asgd.AsyncParameterServerStrategy(cluster.resolver, synchronous=True, max_staleness=2)
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=2, synchronous=True)
    (x, y), _ = flat
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(
            tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.05, momentum=0.9)),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    with pytest.raises(ValueError, match="GEM"):
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=4, verbose=0)
    assert strategy.stats().windows == 0


def test_split_round():
    assert rounds.split_round(10, 2) == [5, 5]
    assert rounds.split_round(7, 2) == [4, 3]
    assert rounds.split_round(1, 3) == [1, 0, 0]
    assert rounds.split_round(12, 2, cycle=4) == [8, 4]


def test_compression_validation_and_stats_work_in_rounds(cluster, flat):
    """int8 pushes with error feedback, `fit`'s validation on the workers and
    `model_stats` under synchronous rounds: every push at staleness 0, and the
    held-out loss falls."""
    (x, y), (xt, yt) = flat
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=5, synchronous=True, compression="int8"
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(
        x, y, batch_size=32, epochs=2, steps_per_epoch=20, validation_data=(xt, yt), verbose=0
    )
    stats = strategy.model_stats(model)
    assert stats.windows == stats.applied == 8 and stats.max_staleness == 0
    assert stats.bytes_pushed_per_window < stats.bytes_pulled_per_window  # int8 payloads
    assert all(r.staleness == 0 for r in strategy.window_log(model))
    assert history.history["val_loss"][-1] < history.history["val_loss"][0]
    loss, accuracy = model.evaluate(xt, yt, verbose=0)
    assert np.isfinite(loss) and accuracy == pytest.approx(history.history["val_accuracy"][-1])
