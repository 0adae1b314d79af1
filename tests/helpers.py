"""What tests share besides fixtures: the repository root, the digits model's compile, a
flattened-digits MLP and its seeded compile (for comparisons with plain Keras), the
supported versions as internals.py states them, a bounded call for error-path tests, a
fit whose only worker is killed in the middle of a closure, and a callback that kills a
task mid-`fit` and restarts it."""

import ast
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.runtime.window import APPLIED_RING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_digits(model, optimizer=None):
    """Compiles `model` for digits: logits, sparse labels, accuracy; SGD(0.05, m 0.9) by default."""
    model.compile(
        optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


DIGITS_BATCH = 32
_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digits_mlp():
    """A small MLP on flattened digits (64 inputs, 10 logits)."""
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


def decaying_sgd(epochs=6, rows=1438):
    """SGD with momentum, its rate decaying to 0 over `epochs` of `rows`
    training rows (held-out accuracy then ends within about a point of plain
    Keras over 16 seeds; at a constant rate plain Keras's own last epoch
    varies by 4)."""
    steps = -(-rows // DIGITS_BATCH)
    return keras.optimizers.SGD(
        keras.optimizers.schedules.CosineDecay(0.1, epochs * steps), momentum=0.9
    )


def build_compiled(strategy, build, compile_kw):
    """`build()` compiled with `compile_kw`, under `strategy`'s scope (None:
    plain Keras), from the same seed. `compile_kw["optimizer"]` is a function
    that makes one (default: `decaying_sgd()`)."""
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = build()
        kw = dict(optimizer=decaying_sgd, loss=_SCCE, metrics=["accuracy"])
        kw.update(compile_kw)
        model.compile(**dict(kw, optimizer=kw["optimizer"]()))  # a new optimizer each
    return model


def linear_digits_model(strategy, metrics=()):
    """A linear model of the digits images, compiled with SGD(0.05) under `strategy`."""
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
        )
        model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics),
        )
    return model


def same_weights(a, b):
    """True if the weight lists `a` and `b` are equal, array by array."""
    return all(np.array_equal(u, v) for u, v in zip(a, b))


def supported_versions():
    """`SUPPORTED_KERAS`, `SUPPORTED_TF` read from internals.py's source."""
    with open(os.path.join(ROOT, "tf_asgd", "internals.py")) as f:
        tree = ast.parse(f.read())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("SUPPORTED_KERAS", "SUPPORTED_TF"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["SUPPORTED_KERAS"], values["SUPPORTED_TF"]


ERROR_BOUND_SECS = 30  # an error reaches the user within 30 s


def bounded(fn, seconds):
    """Runs `fn()` in a thread; returns `(value, exception, seconds taken)`.

    Fails the test if `fn` has not returned or raised after `seconds`.
    """
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # KeyboardInterrupt included: it is what we test
            out["error"] = e

    # If the hang holds the GIL, join's timeout cannot return: end the
    # process (with every thread's traceback) rather than hang the suite.
    faulthandler.dump_traceback_later(seconds + 120, exit=True, file=sys.stderr)
    t0 = time.time()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    secs = time.time() - t0
    faulthandler.cancel_dump_traceback_later()
    if thread.is_alive():
        pytest.fail(f"no result and no error after {seconds} s: the call hangs")
    return out.get("value"), out.get("error"), secs


@contextlib.contextmanager
def worker_killed_mid_closure(local_cluster, digits, **strategy_options):
    """Fits the digits convnet on one worker whose closure is killed half-applied.

    A closure of 8 windows of 1 step (60 ms of emulated device time a step) runs on the
    only worker; once some of its windows have pushed (their ids are in the PS's ring of
    applied windows) and before it returns, the worker is SIGKILLed, then restarted. TF's
    coordinator runs the closure again: the windows that had pushed are replays (no steps,
    no push), the others run. Checks that every window is applied once: tickets, steps and
    records agree.

    Args:
        local_cluster: the `local_cluster` fixture (the cluster is the test's own).
        digits: the `digits` fixture.
        **strategy_options: more `AsyncParameterServerStrategy` options (`compression`).

    Yields:
        `(strategy, model, steps)`, the cluster still running, for the caller's own checks.
    """
    (x, y), _ = digits
    k, n_sync, steps = 8, 1, 48
    with local_cluster(1, 1, own=True, shared_process=False) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver,
            n_sync=n_sync,
            windows_per_closure=k,
            per_worker_dataset_fn=tf_asgd.data.emulated_device_time(60),
            **strategy_options,
        )
        with strategy.scope():
            model = compile_digits(tf_asgd.models.digits_convnet())
        events = {}

        def partly_applied():
            state = strategy.model_states.get(model)
            trainer = None if state is None else state.trainer
            if trainer is None:
                return None
            applied = trainer.window.applied_windows.numpy()
            for _, windows, *_ in list(trainer._pending):
                ids = [i for _, i in windows]
                done = [applied[i % APPLIED_RING] == i + 1 for i in ids]
                if any(done) and not all(done):
                    return ids, sum(done)
            return None

        def inject():
            try:
                deadline = time.time() + 120
                while time.time() < deadline:
                    found = partly_applied()
                    if found:
                        cluster.kill_task("worker:0", signal.SIGKILL)
                        events["killed"] = found
                        break
                    time.sleep(0.01)
                time.sleep(1.0)
                cluster.restart_task("worker:0")
                events["restarted"] = True
            except BaseException as e:  # reported by the main thread
                events["error"] = e

        helper = threading.Thread(target=inject, daemon=True)
        helper.start()
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=steps, verbose=0)
        helper.join(120)
        assert "error" not in events, events.get("error")
        assert "killed" in events and events.get("restarted"), events
        ids, pushed_before_kill = events["killed"]
        trainer = strategy.model_states.get(model).trainer
        log = strategy.window_log(model)
        stats = strategy.model_stats(model)
        replays = [r for r in log if r.replayed]
        print(
            f"killed with {pushed_before_kill} of {len(ids)} windows of a closure pushed; "
            f"{len(replays)} replays; closures {trainer.closure_log}"
        )
        # The windows that had pushed before the kill were replayed, not re-applied.
        assert len(replays) >= pushed_before_kill >= 1
        assert {r.window_id for r in replays} <= set(ids)
        # Every window once: one record each, one ticket and n_sync steps per window.
        assert len(log) == steps and len({r.window_id for r in log}) == steps
        assert stats.windows == steps == sum(r.pushed for r in log)
        assert int(model.optimizer.iterations.numpy()) == steps * n_sync
        yield strategy, model, steps


class KillTask(keras.callbacks.Callback):
    """SIGKILLs `task` of `cluster` after `at` windows of `fit` (Keras's batch-level calls),
    then restarts it on its port `after` seconds later (None: never), in a thread;
    `events` holds when each happened (monotonic), or the restart's error."""

    def __init__(self, cluster, task="ps:0", at=20, after=2.0):
        super().__init__()
        self.cluster, self.task, self.at, self.after = cluster, task, at, after
        self.events, self.thread, self.windows = {}, None, 0

    def on_train_batch_end(self, batch, logs=None):
        self.windows += 1
        if self.thread is None and self.windows >= self.at:
            self.cluster.kill_task(self.task)
            self.events["killed"] = time.monotonic()
            self.thread = threading.Thread(target=self._restart, daemon=True)
            self.thread.start()

    def _restart(self):
        if self.after is None:
            return
        time.sleep(self.after)
        try:
            self.cluster.restart_task(self.task)
            self.events["restarted"] = time.monotonic()
        except BaseException as e:  # reported by the test
            self.events["error"] = e


def dense_digits_model(strategy, optimizer=None, seed=None):
    """Digits images through a 64-unit dense layer, compiled by `compile_digits` under
    `strategy` (with `optimizer`, SGD(0.05, m 0.9) by default); its first kernel
    (64 x 64 floats) splits over PS tasks under a small `MaxSizePartitioner`."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        return compile_digits(model, optimizer)
