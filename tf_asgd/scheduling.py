"""Window scheduling: one `ClusterCoordinator` closure per `n_sync` window.

A window is GPU A-SGD's unit of work (Paine et al. 2013). On one worker it:

1. pulls the central variables and the version counter from the PS,
2. runs `n_sync` local steps on the worker's own batches, carrying the
   weights, optimizer state and metric state as loop tensors (the model's
   `stateless_call`; nothing is written to the PS meanwhile),
3. pushes the accumulated update `local_end - local_start` once: it takes a
   version ticket (staleness `tau` = tickets issued since the pull) and the
   PS adds `scale(tau) * update` (`update_rules.staleness_scale`).

This module is the chief's side (`WindowTrainer`: schedule windows, record
their results, metrics and logs). The worker's side, phase by phase, is
`window.WindowFunction`; the PS side of a push is `push.push_update`; the
result a window returns, and its record, are defined in `records`.

Exactly once: when a worker dies, TF's `ClusterCoordinator` puts its
in-flight closure back and runs it again on a live worker. If the dead worker
had already pushed (it died between its push and returning the result), a
plain re-run would push that window a second time. Each window therefore
carries an id from the chief; a push records it in a ring of applied ids on
the PS, and an attempt whose id is already recorded runs no steps and pushes
nothing (`WindowRecord.replayed`).
"""

import time
import weakref

import numpy as np
import tensorflow as tf
from keras import StatelessScope

from tf_asgd import internals, outer
from tf_asgd.push import device_of, nbytes, push_update, raw, shard_variables
from tf_asgd.records import WindowRecord, WindowResultLayout
from tf_asgd.window import APPLIED_RING, WindowFunction

# push_update and WindowRecord are re-exported: tests and tools use them from here.
__all__ = ["APPLIED_RING", "WindowRecord", "WindowTrainer", "push_update"]

MAX_IN_FLIGHT_PER_WORKER = 2  # windows scheduled but unfinished, per worker


class WindowTrainer:
    """Trains one Keras model with window closures on the workers.

    Built by the strategy (`AsyncParameterServerStrategy._trainer_for`) when
    the Keras hook makes the train function of a model whose strategy is an
    `AsyncParameterServerStrategy`; users do not create it. It holds its
    model by weak reference: the strategy keeps trainers by model, and a
    model that is gone takes its trainer with it.
    """

    def __init__(self, model, strategy):
        self._model = weakref.ref(model)
        self.strategy = strategy
        self.optimizer = model.optimizer  # a recompiled model gets a new trainer
        self.coordinator = strategy.coordinator
        opt = model.optimizer
        self.push_rule = getattr(opt, "asgd_push_rule", None)
        self.variables = list(model.trainable_variables) + list(
            model.non_trainable_variables
        )
        for v in self.variables:
            device = device_of(raw(v))
            if "/job:ps" not in device:
                raise ValueError(
                    f"Variable {v.path!r} lives on {device or 'the chief'}, "
                    "not on a parameter server: the model was built outside "
                    "`AsyncParameterServerStrategy.scope()`. Create and compile "
                    "the model inside `with strategy.scope():`."
                )
        # The outer optimizer's state, per variable and PS shard, beside it;
        # non-trainable variables (e.g. moving statistics) get none.
        self.outer = strategy._outer_optimizer_for(self.push_rule)
        n_train = len(model.trainable_variables)
        with strategy.scope():
            self.outer_slots = [
                [outer.create_slots(self.outer, shard) if i < n_train else {}
                 for shard in shard_variables(raw(v))]
                for i, v in enumerate(self.variables)
            ]
        self.window = WindowFunction(self)  # creates the worker-side state
        self.window_log = []  # a WindowRecord per finished window, in order seen
        self._ticketed = 0  # windows of window_log that took a version ticket
        # The metric values at the epoch's start; a window's metrics start from
        # them (read when the window function is traced).
        self.metric_init = [np.asarray(v.numpy()) for v in model.metrics_variables]
        self.layout = WindowResultLayout(self.metric_init, has_pi=bool(self.push_rule))
        self._metric_sum = None
        self._epoch_windows = []
        self._pending = []
        self._next_window_id = 0
        self._epoch_step = 0  # steps scheduled this epoch
        self._max_in_flight = MAX_IN_FLIGHT_PER_WORKER * strategy.num_workers
        self._logs, self._logs_at = None, 0.0
        ids = [id(v) for v in model.metrics_variables]
        self._loss_index = [ids.index(id(v)) for v in internals.loss_tracker(model).variables]
        self.bytes_per_pull = nbytes(self.variables)
        self.bytes_per_push = self.bytes_per_pull
        self._window = tf.function(self.window.run)

    @property
    def model(self):
        """The Keras model trained (None once it is gone)."""
        return self._model()

    # ---- chief side -------------------------------------------------------

    def train_function(self, iterator):
        """Keras's `train_function`: schedules one window.

        It returns at once while fewer than `MAX_IN_FLIGHT_PER_WORKER` windows
        per worker are unfinished, else once the oldest one finishes: enough
        queued to keep every worker busy, few enough that the progress bar
        follows the training and a stop waits for seconds, not an epoch.
        """
        window_id = tf.constant(self._next_window_id, tf.int64)
        self._next_window_id += 1
        # An epoch is exactly its steps: its last window may be shorter.
        n_sync = self.strategy.n_sync
        steps = self.strategy._steps_per_epoch(self.model)
        num_steps = n_sync if not steps else max(1, min(n_sync, steps - self._epoch_step))
        self._epoch_step += num_steps
        rv = self.coordinator.schedule(
            self._window, args=(iterator, tf.constant(num_steps, tf.int32), window_id),
        )
        self._pending.append(rv)
        self._drain(block=True, keep=self._max_in_flight)
        # Progress for callbacks, refreshed a few times a second at most: the
        # chief's time per window bounds throughput at small n_sync.
        now = time.perf_counter()
        if self._logs is None or now - self._logs_at > 0.25:
            self._drain(block=False)
            self._logs, self._logs_at = self.logs(), now
        return self._logs

    def _drain(self, block, keep=0):
        """Records finished windows in the order they finish; with `block`,
        waits until at most `keep` are unfinished.

        Any finished window frees a slot, not only the oldest: waiting for the
        oldest would hold every fast worker behind a straggler's window.
        """
        while True:
            ready = [rv for rv in self._pending if internals.remote_value_ready(rv)]
            for rv in ready:
                self._pending.remove(rv)
                self._record(np.asarray(rv.fetch()))
            if not block or len(self._pending) <= keep:
                return
            internals.wait_briefly(self._pending[0])

    def _record(self, packed):
        """Appends the `WindowRecord` of one window's fetched result and adds
        its metric deltas to the epoch's sums."""
        header, values, pi = self.layout.unpack(packed)
        total, count = (values[i] for i in self._loss_index)
        record = WindowRecord(
            worker=int(header["worker"]),
            pushed=bool(header["pushed"]),
            staleness=int(header["staleness"]),
            loss=float(total / count) if count else float("nan"),
            seen_at=time.perf_counter(),
            finished_at=float(header["finished_at"]),
            state=tuple(values),
            pi=pi,
            replayed=bool(header["replayed"]),
        )
        self.window_log.append(record)
        self._ticketed += record.staleness >= 0
        self._epoch_windows.append(record)
        if self._metric_sum is None:
            self._metric_sum = values
        else:
            self._metric_sum = [a + b for a, b in zip(self._metric_sum, values)]

    def _metric_results(self, state):
        """The model's metric results for metric-variable values `state`."""
        mapping = list(zip(self.model.metrics_variables, state))
        with StatelessScope(state_mapping=mapping):
            return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def window_results(self, record):
        """The metric results (loss, accuracy, ...) of one window's own steps."""
        return self._metric_results(record.state)

    def reset_metrics(self):
        """Starts an epoch's metrics from the model's (just reset) metric variables."""
        self.metric_init = [np.asarray(v.numpy()) for v in self.model.metrics_variables]
        self._metric_sum = None
        self._epoch_windows = []
        self._epoch_step = 0
        self._logs = None

    def metric_values(self):
        """The epoch's metric variable values: its start plus every window's deltas."""
        if self._metric_sum is None:
            return list(self.metric_init)
        return [i + s for i, s in zip(self.metric_init, self._metric_sum)]

    def logs(self, counters=False):
        """Metric results over the windows finished so far this epoch.

        `counters` adds the PS counters (a few reads from the PS: once an
        epoch, not once a window).
        """
        logs = self._metric_results(self.metric_values())
        if counters:
            logs.update(self.strategy.stats(self).as_logs())
        else:
            # As the epoch-end logs count them (the PS version): pushes made,
            # not windows that were skipped (NaN/Inf) or re-runs.
            logs["windows"] = self._ticketed
        pis = [r.pi for r in self._epoch_windows if r.pi is not None and r.pushed]
        if pis:
            mean = np.mean(pis, axis=(0, 1))
            logs.update(gem_pi_mean=mean[0], gem_pi_zero=mean[1], gem_pi_max=mean[2])
        return logs

    def finish(self):
        """Waits for every scheduled window; writes the epoch's metrics back.

        Raises if every window of the epoch held NaN/Inf: training cannot
        progress, and spinning on would hide it.
        """
        self.coordinator.join()
        self._drain(block=True)
        self._epoch_step = 0
        if self._epoch_windows and not any(r.pushed for r in self._epoch_windows):
            raise FloatingPointError(
                f"All {len(self._epoch_windows)} windows of this epoch computed "
                "updates with NaN or Inf; none was pushed. Lower the learning "
                "rate or check the data for NaN/Inf."
            )
        for var, value in zip(self.model.metrics_variables, self.metric_values()):
            var.assign(value)
        return self.logs(counters=True)

