"""The chief's record of a model's finished windows: records, epoch metrics, logs.

`WindowLog` turns each window's fetched result into a `WindowRecord`, adds its metric
deltas to the epoch's sums, keeps each worker's pace, and makes Keras's logs from them.
`scheduling.WindowTrainer` owns one per model and feeds it as closures finish.
"""

import time
import weakref

import numpy as np
from keras import StatelessScope

from tf_asgd import internals
from tf_asgd.runtime.records import WindowRecord, WindowResultLayout


class WindowLog:
    """Every finished window of one model, and the running epoch's metrics.

    Args:
        model: the Keras model trained (held weakly).
        has_pi: whether windows report GEM's pi statistics.

    Attributes:
        records: a `WindowRecord` per finished window, in the order seen.
        metric_init: the metric values at the epoch's start; a window's
            metrics start from them (read when the window function is traced).
        layout: the `WindowResultLayout` of a window's packed result.
        window_s: `(worker, window steps) -> moving average of its windows'
            seconds` (the workers' pace).
    """

    def __init__(self, model, has_pi):
        self._model = weakref.ref(model)
        self.records = []
        self._ticketed = 0  # windows of records that took a version ticket
        self._ran = [0, 0]  # samples and windows of records that ran (not replayed)
        self.metric_init = [np.asarray(v.numpy()) for v in model.metrics_variables]
        self.layout = WindowResultLayout(
            self.metric_init, has_pi=has_pi, num_trainable=len(model.trainable_variables)
        )
        self._metric_sum = None
        self.epoch_records = []  # the records of the running epoch
        self.window_s = {}
        # The loss tracker's (total, count); a model whose `metrics` leave it
        # out (e.g. its own `train_step` with its own loss metrics) has none.
        ids = [id(v) for v in model.metrics_variables]
        tracker = internals.loss_tracker(model)
        tracked = tracker is not None and all(id(v) in ids for v in tracker.variables)
        self._loss_index = [ids.index(id(v)) for v in tracker.variables] if tracked else None

    @property
    def model(self):
        """The Keras model trained (None once it is gone)."""
        return self._model()

    @property
    def samples_per_window(self):
        """The mean samples of the windows that ran so far (replays aside); 0 before any."""
        samples, windows = self._ran
        return samples / windows if windows else 0.0

    def record(self, packed, window_id=-1, steps=None):
        """Appends the `WindowRecord` of one window's fetched result, adds
        its metric deltas to the epoch's sums and its duration to its
        worker's pace."""
        header, values, pi = self.layout.unpack(packed)
        total, count = (values[i] for i in self._loss_index) if self._loss_index else (0.0, 0)
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
            started_at=float(header["started_at"]),
            window_id=int(window_id),
            samples=int(header["samples"]),
        )
        if not record.replayed:
            self._ran[0] += record.samples
            self._ran[1] += 1
            seconds = max(record.finished_at - record.started_at, 0.0)
            key = (record.worker, steps)
            old = self.window_s.get(key)
            self.window_s[key] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self.records.append(record)
        self._ticketed += record.staleness >= 0
        self.epoch_records.append(record)
        if self._metric_sum is None:
            self._metric_sum = values
        else:
            self._metric_sum = [a + b for a, b in zip(self._metric_sum, values)]

    def roll_back(self, since):
        """Marks the records from index `since` on as rolled back (a PS's recovery undid
        their pushes; those marked by an earlier recovery stay as they are); returns the
        newly marked that had pushed."""
        undone = [r for r in self.records[since:] if not r.rolled_back]
        by_id = {id(old): old._replace(rolled_back=True) for old in undone}
        self.records[since:] = [by_id.get(id(r), r) for r in self.records[since:]]
        self.epoch_records = [by_id.get(id(r), r) for r in self.epoch_records]
        self._ticketed -= sum(r.staleness >= 0 for r in undone)
        return [by_id[id(r)] for r in undone if r.pushed and not r.replayed]

    def _metric_results(self, state):
        """The model's metric results for metric-variable values `state`."""
        mapping = list(zip(self.model.metrics_variables, state))
        with StatelessScope(state_mapping=mapping):
            # As Keras's logs: floats, and arrays for a metric whose result
            # is one (`F1Score` per class).
            return internals.pythonify_logs(self.model.get_metrics_result())

    def window_results(self, record):
        """The metric results (loss, accuracy, ...) of one window's own steps."""
        return self._metric_results(record.state)

    def reset_metrics(self):
        """Starts an epoch's metrics from the model's (just reset) metric variables."""
        self.metric_init = [np.asarray(v.numpy()) for v in self.model.metrics_variables]
        self._metric_sum = None
        self.epoch_records = []

    def check_progress(self):
        """Raises `FloatingPointError` if every window of the epoch held NaN or Inf
        (none pushed): training cannot progress, and spinning on would hide it."""
        epoch = self.epoch_records
        if epoch and not any(r.pushed for r in epoch):
            raise FloatingPointError(
                f"All {len(epoch)} windows of this epoch computed "
                "updates with NaN or Inf; none was pushed. Lower the learning "
                "rate or check the data for NaN/Inf."
            )

    def metric_values(self):
        """The epoch's metric variable values: its start plus every window's deltas."""
        if self._metric_sum is None:
            return list(self.metric_init)
        return [i + s for i, s in zip(self.metric_init, self._metric_sum)]

    def logs(self, counters=None):
        """Metric results over the windows finished so far this epoch.

        Args:
            counters: the PS counters' logs (`AsyncStats.as_logs()`, a few
                reads from the PS: once an epoch, not once a window), or None
                for the count of windows that took a ticket.
        """
        logs = self._metric_results(self.metric_values())
        if counters is not None:
            logs.update(counters)
        else:
            # As the epoch-end logs count them (the PS version): pushes made,
            # not windows that were skipped (NaN/Inf) or re-runs.
            logs["windows"] = self._ticketed
        pis = [r.pi for r in self.epoch_records if r.pi is not None and r.pushed]
        if pis:
            mean = np.mean(pis, axis=(0, 1))
            logs.update(gem_pi_mean=mean[0], gem_pi_zero=mean[1], gem_pi_max=mean[2])
        return logs
