"""How a trainer's windows are grouped, scheduled and applied: the interface.

`WindowTrainer` takes Keras's windows and runs them on the workers; its scheduler decides
when each is scheduled and what an epoch's end, a fit's end and a PS's recovery do to
them. Two implement it: `async_scheduler.AsyncScheduler` (the default: each window
pushed on its own, GPU A-SGD) and `round_scheduler.RoundScheduler` (`synchronous=True`:
rounds of N windows from one start, and one outer step on their mean).
"""


class WindowScheduler:
    """The interface a `WindowTrainer`'s scheduler implements (see the module).

    Args:
        trainer: the `WindowTrainer` whose windows it schedules. A scheduler reads its
            public attributes and schedules with `trainer.schedule(windows)`.
    """

    # Pushes of one version the PS may get at once without being stale to one another.
    concurrent_pushes = 1
    # Whether the outer optimizer's slots hold a round's buffer and noise sums.
    round_buffers = False

    def __init__(self, trainer):
        self.trainer = trainer

    @staticmethod
    def check_push_rule(push_rule):
        """Raises where the optimizer's push rule (GEM) cannot run under this scheduler."""
        del push_rule

    @staticmethod
    def default_outer_optimizer(num_workers, rate_peak):
        """The outer optimizer the PS applies when the user gives none.

        Args:
            num_workers: the cluster's workers.
            rate_peak: the workers' rate factor after its warm-up.

        Returns:
            An `outer_optimizers.OuterSGD` or `DelayedNesterov`.
        """
        raise NotImplementedError

    def next_id(self):
        """The id of the window Keras asks for now (taken, where ids are given on asking)."""
        raise NotImplementedError

    def begin_epoch(self, first_id, steps):
        """An epoch's first window, `first_id`, is asked for; the epoch has `steps`."""

    def add(self, num_steps, window_id, steps, left):
        """Keras asked for window `window_id` of `num_steps`; `steps` is the epoch's
        length (0 where unknown), `left` its windows still to come."""
        raise NotImplementedError

    def requeue(self, windows):
        """Scheduling `windows` failed (a PS's loss): they wait to be scheduled again."""

    def before_window(self):
        """Before Keras's next window: trains what a recovery rolled back, if due."""

    def flush(self):
        """Schedules everything asked for (a fit's end)."""
        raise NotImplementedError

    def end_epoch(self):
        """Schedules everything the epoch asked for (its end)."""
        self.flush()

    def close_epoch(self):
        """Every window of the epoch has finished: closes what the epoch opened."""

    def start_epoch(self):
        """An epoch's metrics were reset: forgets what a failed fit left."""

    def retrain(self, windows):
        """Trains `windows` (`(steps or None, id)`: rolled back by a PS's recovery, or
        lost in flight) again, in the shape they first ran."""
        raise NotImplementedError

    def keep(self, windows):
        """A recovery's attempt failed after it took `windows` (`abandon`): they wait for
        the next attempt, which trains them again. Reads nothing on the PS."""
        raise NotImplementedError

    def take_queued(self):
        """Forgets the windows asked for and not scheduled, and returns them."""
        return []

    def drop_queued(self, drop):
        """Forgets the queued windows `(steps, id)` for which `drop` is true; returns them."""
        del drop
        return []

    def epoch_end_waits(self):
        """Whether the running epoch's end waits for every window."""
        return True

    def quiet_at_epoch_end(self):
        """Whether no window is in flight once an epoch's end is done."""
        return True

    def rolls_back_rounds(self):
        """Whether a window cancelled in flight rolls back to the last snapshot (its round
        cannot train it again alone) rather than training again where it is."""
        return False

    def snapshot_if_due(self, recovery):
        """Takes `recovery`'s snapshot when due, at a moment no push is half applied."""
        del recovery
