"""Seeded faults injected into a `LocalCluster` during `fit`, and the exactly-once check.

The pattern of FoundationDB's simulation and Jepsen: faults drawn from a seed, each one
given time to be recovered from (training moves on by some windows) before the next, and
an invariant checked over them all. Results: results/ps_recovery.
"""

import collections
import contextlib
import os
import random
import signal
import subprocess
import threading
import time

import keras
import tensorflow as tf

from tf_asgd.cluster import fault_points

# A fault, as drawn: "kill" a task and restart it on its port; "pause" a PS (SIGSTOP, then
# SIGCONT); "ps_then_worker": a PS killed, then a worker while the chief waits for the PS;
# "point": a push held at a point of `fault_points.POINTS` while every worker is killed.
KINDS = ("kill", "pause", "ps_then_worker", "point")
HOLD_S = 3.0  # how long a "point" fault holds its push; the workers die within 1 s of it


class Chaos(keras.callbacks.Callback):
    """A Keras callback that injects `faults` seeded faults into `cluster`, from the end of
    `fit`'s first epoch on, in a thread; it stops `fit` once they are done.

    Each fault waits until `spacing` more windows have finished since the last one ended
    (the recovery from it worked), at most `patience` seconds (else it stops: `stalled`).

    Args:
        cluster: a `tf_asgd.LocalCluster` made with `shared_process=False`.
        strategy: the `AsyncParameterServerStrategy` training the model.
        faults: how many faults to inject.
        seed: the seed of the draws (kind, task, timings).
        kinds: the kinds drawn from (`KINDS`).
        spacing: windows finished between two faults.
        patience: seconds to wait for them.

    Attributes:
        done: `(kind, tasks)` of each fault injected, in order.
        points: the point of each "point" fault, in order.
        stalled: whether training stopped moving on for `patience` seconds.
        error: what stopped the thread (a restart that failed), else None.

    Example:

    ```python
    chaos = Chaos(cluster, strategy, faults=20, seed=3)
    model.fit(dataset, epochs=10_000, steps_per_epoch=40, callbacks=[chaos])
    assert not violations(strategy, model, windows_run(strategy, model))
    ```
    """

    def __init__(self, cluster, strategy, faults, seed, kinds=KINDS, spacing=8, patience=120.0):
        super().__init__()
        self.cluster, self.strategy, self.faults = cluster, strategy, faults
        self.rng, self.kinds = random.Random(seed), kinds
        self.spacing, self.patience = spacing, patience
        self.done, self.stalled, self.error, self.thread = [], False, None, None
        self.points, self._held, self._arms = [], {}, contextlib.ExitStack()
        if "point" in kinds:  # made before `fit`: its first snapshot then holds them
            anchor = strategy.counters.version
            with strategy.scope(), strategy.extended.colocate_vars_with(anchor):
                self._held = {
                    p: tf.Variable(tf.constant(-1, tf.int64), trainable=False, name="held_ticket")
                    for p in fault_points.POINTS
                }

    def on_train_begin(self, logs=None):
        for point, ticket in self._held.items():  # armed before the window is traced
            self._arms.enter_context(fault_points.armed(point, HOLD_S, ticket))

    def on_train_end(self, logs=None):
        self._arms.close()

    def on_epoch_end(self, epoch, logs=None):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        if not self.thread.is_alive():
            self.model.stop_training = True

    def _windows(self):
        # The log's length, read every 0.1 s: `window_log` would copy the whole log.
        return len(self.strategy.model_states.get(self.model).trainer.window_log)

    def _run(self):
        try:
            for _ in range(self.faults):
                if not self._progress():
                    self.stalled = True
                    return
                kind = self.rng.choice(self.kinds)
                self.done.append((kind, getattr(self, f"_{kind}")()))
        except BaseException as e:  # noqa: BLE001 - the caller reports it
            self.error = e

    def _progress(self):
        start, deadline = self._windows(), time.monotonic() + self.patience
        while self._windows() < start + self.spacing:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        time.sleep(self.rng.uniform(0.0, 1.0))  # anywhere in a window
        return True

    def _kill(self):
        task = self.rng.choice(self.cluster.tasks())
        self.cluster.kill_task(task)
        time.sleep(self.rng.uniform(1.0, 2.0))
        self.cluster.restart_task(task)
        return [task]

    def _pause(self):
        task = self.rng.choice([t for t in self.cluster.tasks() if t.startswith("ps:")])
        pid, seconds = self.cluster.pids()[task], self.rng.uniform(1.0, 4.0)
        # Paused and resumed by a process of its own, started before the pause: the chief
        # may wait for the paused PS inside TF holding the GIL (a function registered on
        # every task, a value written to it), and this thread could then neither start a
        # process nor send SIGCONT.
        pause = f"kill -STOP {pid}; sleep {seconds:.3f}; kill -CONT {pid}"
        try:
            subprocess.run(["sh", "-c", pause], check=True, timeout=seconds + 30)
        finally:
            os.kill(pid, signal.SIGCONT)
        return [task]

    def _point(self):
        point = self.rng.choice(fault_points.POINTS)
        version, held = self.strategy.counters.version, self._held[point]
        deadline = time.monotonic() + self.patience
        ticket = self._arm(held, version, deadline)
        while int(version.numpy()) <= ticket:  # until a push takes it
            if time.monotonic() > deadline:
                raise TimeoutError(f"No push took ticket {ticket} in {self.patience:.0f} s.")
            time.sleep(0.02)
        # Taken: the push is held at the point (or on its way there) for `HOLD_S`.
        time.sleep(self.rng.uniform(0.2, 1.0))
        workers = [t for t in self.cluster.tasks() if t.startswith("worker:")]
        for task in workers:
            self.cluster.kill_task(task)
        held.assign(-1)
        time.sleep(self.rng.uniform(1.0, 2.0))
        for task in workers:
            self.cluster.restart_task(task)
        self.points.append(point)
        return workers

    def _arm(self, held, version, deadline):
        """Arms `held` at a ticket 2 ahead of the version, and returns it once the version
        read after arming shows no push took it meanwhile (else arms again)."""
        while True:
            ticket = int(version.numpy()) + 2
            held.assign(ticket)
            if int(version.numpy()) <= ticket:
                return ticket
            if time.monotonic() > deadline:
                raise TimeoutError(f"Pushes outran every ticket armed in {self.patience:.0f} s.")
            time.sleep(0.02)

    def _ps_then_worker(self):
        tasks = self.cluster.tasks()
        ps = self.rng.choice([t for t in tasks if t.startswith("ps:")])
        worker = self.rng.choice([t for t in tasks if t.startswith("worker:")])
        self.cluster.kill_task(ps)
        time.sleep(self.rng.uniform(0.3, 1.0))
        self.cluster.kill_task(worker)
        time.sleep(self.rng.uniform(1.0, 2.0))
        self.cluster.restart_task(ps)
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.cluster.restart_task(worker)
        return [ps, worker]


def windows_run(strategy, model):
    """The windows the chief gave an id to in `model`'s training (ids 0 to this - 1)."""
    return strategy.model_states.get(model).trainer.next_window_id


def violations(strategy, model, windows):
    """What breaks exactly-once after a `fit` of `windows` windows (ids 0 to windows - 1):
    a window applied twice, a window lost (neither applied nor a replay: a replay's id was
    applied, its record lost with its worker), or counters that disagree.

    Returns:
        A list of sentences, empty where every window was applied exactly once.
    """
    log = [r for r in strategy.window_log(model) if not r.rolled_back]
    applied = [r.window_id for r in log if r.pushed and not r.replayed]
    replayed = {r.window_id for r in log if r.replayed}
    found = []
    twice = sorted(w for w, n in collections.Counter(applied).items() if n > 1)
    if twice:
        found.append(f"applied twice: windows {twice}")
    lost = sorted(set(range(windows)) - set(applied) - replayed)
    if lost:
        found.append(f"lost: windows {lost}")
    stats = strategy.model_stats(model)
    version = int(strategy.counters.version.numpy())
    if not stats.windows == stats.applied == version == windows:
        found.append(
            f"counters: {stats.windows} windows, {stats.applied} applied, version {version}, "
            f"against {windows} windows run"
        )
    return found
