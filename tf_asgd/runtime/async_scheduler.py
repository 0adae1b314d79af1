"""Asynchronous windows (GPU A-SGD, Paine et al. 2013): each pushed on its own.

Windows are queued as Keras asks for them and scheduled `K` to a closure
(`closure_sizes.ClosureSizes`); each pulls, trains and pushes whenever its worker is free.
A PS's recovery puts the rolled-back windows back epoch by epoch (`epochs.Epochs`).
"""

import time

from tf_asgd.rules import outer_optimizers
from tf_asgd.runtime import epochs
from tf_asgd.runtime.scheduler import WindowScheduler


class AsyncScheduler(WindowScheduler):
    """The default `WindowScheduler`: asynchronous windows, a queue of them.

    Args:
        trainer: the `WindowTrainer` whose windows it schedules.
    """

    def __init__(self, trainer):
        super().__init__(trainer)
        self.queue = []  # (num_steps, window_id) asked for by Keras, not yet scheduled
        self._epochs = epochs.Epochs(trainer.strategy.n_sync)  # where rolled-back windows belong
        self._replays = []  # rolled-back earlier epochs' windows, a list per epoch, to train again

    @staticmethod
    def default_outer_optimizer(num_workers, rate_peak):
        return outer_optimizers.default_outer_optimizer(num_workers, rate_peak)

    def next_id(self):
        window_id = self.trainer.next_window_id
        self.trainer.next_window_id += 1
        return window_id

    def begin_epoch(self, first_id, steps):
        self._epochs.begin(first_id, steps)

    def add(self, num_steps, window_id, steps, left):
        self.queue.append((num_steps, window_id))
        full = len(self.queue) >= self.trainer.sizes.size(len(self.queue) + left)
        if not steps or left <= 0 or full:
            self._flush(left)

    def _flush(self, left=0):
        """Schedules every queued window, in closures of `sizes.size` (`left`: the
        epoch's windows still to come after them)."""
        while self.queue:
            k = self.trainer.sizes.size(len(self.queue) + left)
            windows, self.queue = self.queue[:k], self.queue[k:]
            self.trainer.schedule(windows)

    def requeue(self, windows):
        self.queue = list(windows) + self.queue

    def before_window(self):
        """Trains the rolled-back earlier epochs' windows (`retrain`), each epoch's
        finished before the next's start: the training the rollback undid, in the
        shape it had."""
        if not self._replays:
            return
        while self._replays:
            self.trainer.drain(block=True)
            self.queue, queued = list(self._replays[0]), self.queue
            try:
                self._flush()  # a loss here: `retrain` finds the epoch's windows again
            finally:
                self.queue = queued
            self._replays.pop(0)
        self.trainer.drain(block=True)

    def flush(self):
        self.before_window()
        self._flush()

    def retrain(self, windows):
        """Those of earlier epochs epoch by epoch, each epoch's to its end before the
        next starts, then the running epoch's, queued before any other
        (`epochs.Epochs.regroup`). Windows still waiting come too."""
        waiting = [w for ws in [self.queue, *self._replays] for w in ws]
        self.queue, self._replays = self._epochs.regroup(waiting + list(windows))

    def keep(self, windows):
        self.retrain(windows)

    def take_queued(self):
        queued, self.queue = self.queue, []
        return queued

    def drop_queued(self, drop):
        dropped = [w for w in self.queue if drop(w)]
        self.queue = [w for w in self.queue if not drop(w)]
        return dropped

    def epoch_end_waits(self):
        """Unless `epoch_barrier=False`, and the fit goes on after this epoch."""
        trainer = self.trainer
        if self.quiet_at_epoch_end():
            return True
        return trainer.fit_state.epochs_left <= 1 or bool(trainer.model.stop_training)

    def quiet_at_epoch_end(self):
        return getattr(self.trainer.strategy, "epoch_barrier", True)

    def snapshot_if_due(self, recovery):
        """Once every scheduled window has finished: a push cut between two PS tasks'
        writes undone (`PSRecovery.repair_if_cut`, looked for after a replay), else the
        snapshot, when due."""
        trainer = self.trainer
        if recovery.due() or recovery.replayed_since_look(trainer):
            start = time.perf_counter()
            trainer.quiesce()
            if not recovery.repair_if_cut(trainer) and recovery.due():
                recovery.take(trainer, waited=time.perf_counter() - start)
