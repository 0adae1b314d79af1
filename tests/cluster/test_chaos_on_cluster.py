"""A seeded sample of chaos: 20 faults, PS and workers SIGKILLed and restarted one after
another at drawn moments of one `fit` (2 workers, 2 PS, a variable split over both, a
user's `tf.data` pipeline). The invariant after them all: `fit` completes, the PS losses
are recovered, every window is applied exactly once, and no process is left."""

import random
import threading
import time

import keras
import pytest
import tensorflow as tf

import tf_asgd

from helpers import dense_digits_model
from launching import alive

pytestmark = pytest.mark.usefixtures("hang_guard")

FAULTS, SEED = 20, 0
STEPS, N_SYNC = 40, 5


class _Chaos(keras.callbacks.Callback):
    """From the first epoch's end on, in a thread: `FAULTS` faults, each a SIGKILL of a
    drawn task (ps:0, ps:1 or a worker) 0.5 to 2 s after the last one's restart, and a
    restart on its port 1 to 2 s after the kill. Stops the `fit` once they are done."""

    def __init__(self, cluster):
        super().__init__()
        self.cluster, self.rng = cluster, random.Random(SEED)
        self.done, self.error, self.thread = [], None, None

    def on_epoch_end(self, epoch, logs=None):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        if not self.thread.is_alive():
            self.model.stop_training = True

    def _run(self):
        tasks = self.cluster.tasks()
        try:
            for _ in range(FAULTS):
                time.sleep(self.rng.uniform(0.5, 2.0))
                task = self.rng.choice(tasks)
                self.cluster.kill_task(task)
                time.sleep(self.rng.uniform(1.0, 2.0))
                self.cluster.restart_task(task)
                self.done.append(task)
        except BaseException as e:  # reported by the test
            self.error = e


@pytest.mark.xfail(
    strict=False,
    reason="known to fail now and then: 1 of its last 6 runs lost a window (neither applied "
    "nor replayed), and under a convnet 5 of 11 seeded runs stopped with a PS loss that a "
    "recovery could not finish within connect_timeout (results/ps_recovery)",
)
def test_twenty_seeded_faults_leave_every_window_applied_exactly_once(local_cluster, digits):
    (x, y), (xt, yt) = digits
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        pids = cluster.pids()
        partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(
            max_shard_bytes=1024
        )
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver,
            n_sync=N_SYNC,
            variable_partitioner=partitioner,
            per_worker_dataset_fn=tf_asgd.data.emulated_device_time(20),
            snapshot_every=2.0,
            connect_timeout=60,
        )
        model = dense_digits_model(strategy, seed=0)
        chaos = _Chaos(cluster)
        start = time.monotonic()
        history = model.fit(
            pipeline.repeat().batch(32),
            epochs=100_000,
            steps_per_epoch=STEPS,
            callbacks=[chaos],
            verbose=0,
        )
        seconds = time.monotonic() - start
        assert chaos.error is None, chaos.error
        assert len(chaos.done) == FAULTS
        # One recovery can cover two kills: a PS killed and back before anything read it,
        # then found lost with the next one.
        ps_kills = sum(task.startswith("ps:") for task in chaos.done)
        assert 0 < len(strategy.recoveries) <= ps_kills, (chaos.done, strategy.recoveries)

        windows = len(history.history["loss"]) * STEPS // N_SYNC
        log = [r for r in strategy.window_log(model) if not r.rolled_back]
        applied = [r.window_id for r in log if r.pushed and not r.replayed]
        # A window whose record was lost with its worker after its push shows only as a
        # replay (its id was in the ring of applied ids when it ran again).
        replayed = {r.window_id for r in log if r.replayed}
        assert len(applied) == len(set(applied))  # none twice
        missing = sorted(set(range(windows)) - set(applied) - replayed)
        assert not missing, [
            (r.window_id, r.pushed, r.replayed, r.rolled_back)
            for r in strategy.window_log(model)
            if r.window_id in missing
        ]  # none lost
        stats = strategy.model_stats(model)
        assert stats.windows == stats.applied == int(strategy.counters.version.numpy())
        assert stats.windows == windows  # each once
        assert model.evaluate(xt, yt, verbose=0)[1] > 0.85
        assert seconds < 240, seconds
    assert not [p for p in pids.values() if alive(p)]
