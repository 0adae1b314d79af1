"""Which epoch each window belongs to, and the windows of a rollback regrouped by it.

A PS's recovery rolls pushes back (`ps_recovery`); `WindowTrainer.retrain` trains their
windows again as they first ran: each earlier epoch's windows together, finished before the
next epoch's start (the epoch's end they ran under), then the running epoch's. Trained
again as one asynchronous burst instead, they cost a model accuracy: results/ps_recovery.
"""

import bisect


class Epochs:
    """The epochs a trainer began, each as `(its first window id, its steps)`.

    Args:
        n_sync: the strategy's window length, in steps.

    Example:

    ```python
    epochs = Epochs(n_sync=10)
    epochs.begin(0, 25)  # windows 0, 1, 2 (of 10, 10 and 5 steps)
    epochs.begin(3, 25)
    running, earlier = epochs.regroup([(None, 1), (None, 2), (10, 3)])
    # running == [(10, 3)]; earlier == [[(10, 1), (5, 2)]]
    ```
    """

    def __init__(self, n_sync):
        self.n_sync = n_sync
        self.began = []  # (first window id, steps or None outside `fit`)
        self._firsts = []  # the first window ids alone, for `bisect`

    def begin(self, first_window_id, steps):
        """Records that an epoch of `steps` steps begins with window `first_window_id`."""
        self.began.append((first_window_id, steps))
        self._firsts.append(first_window_id)

    def index(self, window_id):
        """The index of the epoch window `window_id` belongs to (-1 before any)."""
        return bisect.bisect_right(self._firsts, window_id) - 1

    def window_steps(self, window_id):
        """The steps of window `window_id`: `n_sync`, or fewer for an epoch's last."""
        epoch = self.index(window_id)
        if epoch < 0 or not self.began[epoch][1]:
            return self.n_sync
        first, steps = self.began[epoch]
        return max(1, min(self.n_sync, steps - (window_id - first) * self.n_sync))

    def regroup(self, windows):
        """`windows` (`(steps or None, id)`, an id at most once after merging) by epoch.

        Returns:
            `(the running epoch's windows, [each earlier epoch's windows, in order])`,
            each a list of `(steps, id)` sorted by id; steps not given are computed.
        """
        steps = {}
        for n, window_id in windows:
            steps[window_id] = n or steps.get(window_id)
        by_epoch = {}
        for window_id in sorted(steps):
            n = steps[window_id] or self.window_steps(window_id)
            by_epoch.setdefault(self.index(window_id), []).append((n, window_id))
        running = by_epoch.pop(len(self.began) - 1, [])
        return running, [by_epoch[e] for e in sorted(by_epoch)]
