"""How many windows a closure carries, and how long it may start new ones.

`K` windows go to one `ClusterCoordinator` closure: enough that a closure is about
`TARGET_CLOSURE_S` of work on a worker (each schedule costs the chief), few enough that
closures shrink towards an epoch's end. A closure stops starting windows after its budget,
so a worker slowed down meanwhile hands its windows back. Measured: results/throughput.
`ClosureWaits` bounds how long the chief waits for closures that neither finish nor fail.
"""

import math
import statistics
import time

from tf_asgd import errors

# Automatic K: about this much work on a worker per closure (shorter closures were slower:
# results/throughput/README.md).
TARGET_CLOSURE_S = 0.2
MAX_WINDOWS_PER_CLOSURE = 256
MIN_BUDGET_S = 0.1  # a closure may always start windows for this long
BUDGET_FACTOR = 4  # ... and for this many times what its windows should take


class ClosureSizes:
    """A trainer's closure sizes, from its workers' measured pace.

    Args:
        strategy: the strategy (read: `n_sync`, `num_workers`, `windows_per_closure`).
        log: the trainer's `window_log.WindowLog` (read: `window_s`, each worker's
            moving average of a window's seconds).
    """

    def __init__(self, strategy, log):
        self.strategy, self.log = strategy, log

    def pace(self):
        """Seconds a window of `n_sync` steps takes on a typical worker (the
        lower median of the workers' moving averages: a single straggler
        does not count), or None before such a window was measured."""
        n_sync = self.strategy.n_sync
        paces = [s for (_, steps), s in self.log.window_s.items() if steps == n_sync]
        return statistics.median_low(paces) if paces else None

    def windows_per_closure(self):
        """`K`: the strategy's `windows_per_closure`, or automatic (about
        `TARGET_CLOSURE_S` of windows at a typical worker's measured pace;
        1 until a window has been measured)."""
        fixed = getattr(self.strategy, "windows_per_closure", None)
        if fixed:
            return fixed
        pace = self.pace()
        if pace is None:
            return 1
        k = TARGET_CLOSURE_S / max(pace, 1e-6)
        return int(min(MAX_WINDOWS_PER_CLOSURE, max(1, round(k))))

    def size(self, windows_left):
        """Windows in the next closure, with `windows_left` of the epoch not
        yet scheduled: `K`, but no more than an even share per worker (closures
        shrink towards an epoch's end, so no worker is left with a long one)."""
        share = -(-windows_left // self.strategy.num_workers)
        return max(1, min(self.windows_per_closure(), share))

    def budget(self, windows):
        """Seconds after which a closure of `windows` starts no new window:
        `BUDGET_FACTOR` times what they should take at a typical worker's
        pace, at least `MIN_BUDGET_S` (no limit before any window was
        measured). A window's time varies with the machine's load: a tight
        budget would cut closures short, and each cut costs a schedule."""
        pace = self.pace()
        if pace is None:
            return 1e9
        return max(MIN_BUDGET_S, BUDGET_FACTOR * windows * pace)


class ClosureWaits:
    """Bounds the chief's wait for its scheduled closures.

    TF's coordinator waits without a bound for a closure whose worker neither finishes
    nor fails it (a stopped process keeps its connection open). Once no closure has
    finished for the strategy's `connect_timeout`, plus the oldest pending closure's
    budget, `check` raises `errors.WorkerStalledError` naming the workers that finished
    none meanwhile.

    Args:
        strategy: the strategy (read: `connect_timeout`, `cluster_spec`).
        during: what waits, as the error names it: `"fit"` or `"evaluate"`.
    """

    def __init__(self, strategy, during="fit"):
        self.strategy, self.during = strategy, during
        self._finished_at = {}  # worker index -> when its last closure finished
        self._progress = time.monotonic()

    def finished(self, worker):
        """A closure finished on `worker` (its index)."""
        self._progress = self._finished_at[worker] = time.monotonic()

    def check(self, pending):
        """Raises `errors.WorkerStalledError` when the closures `pending`, as
        `(time.monotonic() when scheduled, budget s)` pairs, have waited past the bound
        with none finished."""
        if not pending:
            return
        start, budget = min(pending)
        since, now = max(start, self._progress), time.monotonic()
        bound = float(self.strategy.connect_timeout) + (budget if budget < 1e8 else 0.0)
        if now - since <= bound:
            return
        addresses = self.strategy.cluster_spec.get("worker", [])
        silent = [i for i in range(len(addresses)) if self._finished_at.get(i, -math.inf) < since]
        tasks = [
            ("worker", i, addresses[i], f"finished no closure for {now - since:.0f} s")
            for i in silent or range(len(addresses))
        ]
        raise errors.WorkerStalledError(tasks, round(now - since), self.during)
