"""Push counters on the parameter server and the statistics read from them.

The version counter is the heart of staleness: every push takes a unique
ticket from it, and staleness is the number of tickets issued between a
worker's pull and its push.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tf_asgd.rules import noise_scale

STALENESS_BINS = 256  # histogram bins; the last one also counts anything larger


@dataclasses.dataclass
class AsyncStats:
    """Per-run counters of an `AsyncParameterServerStrategy`.

    What `strategy.stats()` and `strategy.model_stats(model)` return: the PS's
    counters, read in one round trip, since the strategy was created (over every
    `fit` and model trained under it). Its `repr` is a short summary.

    Attributes:
        windows: pushes that took a version ticket (applied or dropped as stale).
        applied: pushes applied to the central variables.
        mean_staleness: mean staleness of the ticketed pushes.
        max_staleness: largest staleness seen (saturates at 255).
        dropped_stale: pushes dropped because staleness > `max_staleness`.
        dropped_nonfinite: windows whose update held NaN/Inf; never pushed.
        bytes_pulled: bytes read from the PS by window pulls.
        bytes_pushed: bytes sent to the PS by ticketed pushes (dropped ones too):
            the update's payload as it crosses, compressed under the strategy's
            `compression`.
        staleness_histogram: counts of pushes by staleness 0..255 (a NumPy
            int64 array of 256 bins; the last also counts larger ones).
        bytes_pulled_per_window: bytes one window's pull reads (0 if unknown).
        bytes_pushed_per_window: bytes of one window's push payload (0 if
            unknown): the sizes of the tensors that carry the update.
        bytes_pulled_per_sample: `bytes_pulled_per_window` over the mean
            samples a window of the model trained on (0 if unknown).
        bytes_pushed_per_sample: likewise for the push.
        outer_gain: how many windows' worth a round of N pushes moves the
            central weights where they agree (`outer_optimizers.outer_gain` of the
            model's outer optimizer): the factor by which the strategy scales
            the effective learning rate over plain averaging (1.0). N under the
            synchronous default, about 1 under the asynchronous one
            (docs/defaults.md).
        lr_scale: the factor on each worker's learning rate (the strategy's
            `lr_scaling`) that it tends to: the workers' local steps run at the
            compiled optimizer's rate times it (1.0: the user's rate). With
            `outer_gain`, it is how much the strategy scales the effective rate.
        lr_scale_peak: the factor after the warm-up: N under `"anneal"` (the
            default for Adam and its kin), from which it falls toward `lr_scale`
            as 1/t of each `fit`'s steps; `lr_scale` itself otherwise.
        lr_warmup_steps: the optimizer steps (every worker's) at the start of
            each `fit` over which the workers' factor rises linearly from 1 to
            `lr_scale_peak` (a quarter of the running or last fit's steps under
            `"anneal"`, 5% otherwise; at most `2 / (1 - beta_2)` for Adam's kin).
        lr_scale_end: the factor at the running or last `fit`'s last step.
        workers_learning_rate: the rate the workers' local steps run at now: the
            compiled optimizer's at the global step, times the factor (also in
            `fit`'s logs, so `History` and TensorBoard show it).
        local_steps_own: whether each worker's local optimizer counts its own
            steps for what it derives from them for its own moments (Adam's
            bias correction), its schedule seeing the global count: True for
            every compiled optimizer; False where a model's own `train_step`
            drives further optimizers on the PS, whose counters stay global.
        noise_scale: the gradient noise scale of the last finished epoch's
            synchronous rounds, in windows (McCandlish et al. 2018,
            `rules.noise_scale`): about how many workers' windows a round can
            average before another worker stops paying about linearly. `nan`
            where it is not measured (asynchronous pushes, an outer optimizer
            without a round buffer, before an epoch has ended).
        noise_scale_rounds: the rounds `noise_scale` was read from.

    Example:

    ```python
    model.fit(x, y, epochs=3)
    stats = strategy.model_stats(model)
    print(stats)  # AsyncStats(windows=..., applied=..., staleness mean ... max ...)
    assert stats.applied == stats.windows - stats.dropped_stale
    ```
    """

    windows: int
    applied: int
    mean_staleness: float
    max_staleness: int
    dropped_stale: int
    dropped_nonfinite: int
    bytes_pulled: int
    bytes_pushed: int
    staleness_histogram: np.ndarray
    bytes_pulled_per_window: int = 0
    bytes_pushed_per_window: int = 0
    bytes_pulled_per_sample: float = 0.0
    bytes_pushed_per_sample: float = 0.0
    outer_gain: float = 1.0
    lr_scale: float = 1.0
    lr_warmup_steps: int = 0
    lr_scale_peak: float = 1.0
    lr_scale_end: float = 1.0
    workers_learning_rate: float = float("nan")
    local_steps_own: bool = True
    noise_scale: float = float("nan")
    noise_scale_rounds: int = 0

    @property
    def workers_that_pay(self):
        """`noise_scale.workers_that_pay(noise_scale)`: the workers that pay about
        linearly by the last epoch's noise scale (None where it is not measured)."""
        return noise_scale.workers_that_pay(self.noise_scale)

    def __repr__(self):
        # A summary (the histogram's counts by staleness where not zero), not
        # the 256 bins: a dataclass's repr would print the whole array.
        hist = np.asarray(self.staleness_histogram)
        seen = np.nonzero(hist)[0]
        counts = ", ".join(f"{tau}: {int(hist[tau])}" for tau in seen[:8])
        if len(seen) > 8:
            counts += ", ..."
        return (
            f"AsyncStats(windows={self.windows}, applied={self.applied}, "
            f"dropped_stale={self.dropped_stale}, dropped_nonfinite={self.dropped_nonfinite},\n"
            f"           staleness mean {self.mean_staleness:.2f} max {self.max_staleness} "
            f"(pushes by staleness {{{counts}}}), pulled {_megabytes(self.bytes_pulled)}, "
            f"pushed {_megabytes(self.bytes_pushed)}, outer gain {self.outer_gain:.2f}, "
            f"workers' rate {self._rate_summary()}"
            f"{self._noise_summary()})"
        )

    def _rate_summary(self):
        if self.lr_scale_peak == self.lr_scale:
            return f"x{self.lr_scale:.3g}"
        return (
            f"x{self.lr_scale_peak:.3g} falling toward x{self.lr_scale:.3g} "
            f"(x{self.lr_scale_end:.3g} at the fit's end)"
        )

    def _noise_summary(self):
        if not self.noise_scale_rounds:
            return ""
        rounds = self.noise_scale_rounds
        return f",\n           noise scale {self.noise_scale:.3g} windows ({rounds} rounds)"

    def as_logs(self):
        """Windows pushed and mean staleness, for Keras logs (progress bar, History).

        Returns:
            A dict `{"windows": windows, "staleness": mean_staleness,
            "workers_learning_rate": ...}`, with `"noise_scale"` where it is
            measured.
        """
        logs = {"windows": self.windows, "staleness": self.mean_staleness}
        if np.isfinite(self.workers_learning_rate):
            logs["workers_learning_rate"] = self.workers_learning_rate
        if self.noise_scale_rounds:
            logs["noise_scale"] = self.noise_scale
        return logs


def _megabytes(n):
    return f"{n / 1e6:.1f} MB"


class PushCounters(tf.Module):
    """Version ticket and counters, created on the (first) PS.

    Create under the strategy's scope. Every method that changes a counter is
    called from inside a window closure on a worker; the ops run on the PS.
    """

    def __init__(self):
        super().__init__(name="asgd_counters")
        self.version = tf.Variable(0, dtype=tf.int64, trainable=False, name="version")
        # Colocated with the version (so never split by a partitioner): a
        # push updates them in one place.
        with tf.distribute.get_strategy().extended.colocate_vars_with(self.version):
            self._create_counters()

    def _create_counters(self):
        self.staleness_sum = tf.Variable(0, dtype=tf.int64, trainable=False, name="staleness_sum")
        self.dropped_stale = tf.Variable(0, dtype=tf.int64, trainable=False, name="dropped_stale")
        self.dropped_nonfinite = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="dropped_nonfinite"
        )
        self.histogram = tf.Variable(
            tf.zeros([STALENESS_BINS], tf.int64), trainable=False, name="staleness_histogram"
        )

    def take_ticket(self, pulled_version, push=None, round_size=1):
        """Takes a version ticket; returns `(tau, ticket)` and records `tau`.

        Call under `tf.control_dependencies` on the window's update, so that the
        ticket is taken when the update exists, not at pull time.

        Args:
            pulled_version: int64 scalar, the version read at pull time.
            push: None, or a bool scalar: where false, no ticket is taken and
                nothing is recorded (the tau returned is then meaningless).
            round_size: pushes per synchronous round (1: asynchronous). The
                pushes of a round start from one pull and make one step
                together: `tau` counts only whole rounds between the pull and
                the push (0 for each push of the round it pulled for).

        Returns:
            `(tau, ticket)`: the staleness and the push's 0-based version
            ticket, int64 scalars.
        """
        count = tf.constant(1, tf.int64) if push is None else tf.cast(push, tf.int64)
        if push is None:
            ticket = self._next_ticket()
        else:  # where not pushed, the version is read, not advanced
            ticket = tf.cond(push, self._next_ticket, self.version.read_value)
        tau = ticket - pulled_version
        if round_size > 1:
            tau = tau // round_size * round_size
        bin_ = tf.clip_by_value(tau, 0, STALENESS_BINS - 1)
        record = [
            self.staleness_sum.assign_add(tau * count, read_value=False),
            # A dense add: TF runs a scatter_add on an int variable under a
            # shared lock, so two pushes' increments of one bin could race
            # and one be lost (seen: 799 counted of 800); assign_add locks.
            self.histogram.assign_add(
                tf.one_hot(bin_, STALENESS_BINS, dtype=tf.int64) * count, read_value=False
            ),
        ]
        with tf.control_dependencies(record):
            return tf.identity(tau), tf.identity(ticket)

    def _next_ticket(self):
        """The version before adding 1 to it, under the variable's lock. (An
        `assign_add(read_value=True)` reads after its add, outside the lock: two
        pushes at once can read the same value, and so take one ticket and leave
        one unused; tests/unit/test_tickets.py.)"""
        return tf.raw_ops.ResourceCountUpTo(
            resource=self.version.handle, limit=np.iinfo(np.int64).max, T=tf.int64
        )

    @tf.function
    def _read_all(self):
        # One function on the PS and one tensor back: a single round trip.
        with tf.device(self.version.device):
            scalars = tf.stack(
                [self.version, self.staleness_sum, self.dropped_stale, self.dropped_nonfinite]
            )
            return tf.concat([scalars, self.histogram.read_value()], axis=0)

    def stats(self, bytes_per_pull, bytes_per_push, samples_per_window=0.0, outer_gain=1.0):
        """Reads every counter from the PS in one round trip.

        Args:
            bytes_per_pull: bytes one window's pull reads (0 if unknown).
            bytes_per_push: bytes one window's push sends (0 if unknown).
            samples_per_window: the mean samples a window trains on (0 if
                unknown: the per-sample bytes are then 0).
            outer_gain: the model's `outer_optimizers.outer_gain` (1.0 if unknown).

        Returns:
            An `AsyncStats`.
        """
        values = self._read_all().numpy()
        version, staleness_sum, dropped, nonfinite = (int(v) for v in values[:4])
        hist = values[4:]
        seen = np.nonzero(hist)[0]
        return AsyncStats(
            windows=version,
            applied=version - dropped,
            mean_staleness=staleness_sum / version if version else 0.0,
            max_staleness=int(seen[-1]) if len(seen) else 0,
            dropped_stale=dropped,
            dropped_nonfinite=nonfinite,
            bytes_pulled=(version + nonfinite) * bytes_per_pull,
            bytes_pushed=version * bytes_per_push,
            staleness_histogram=hist,
            outer_gain=float(outer_gain),
            bytes_pulled_per_window=bytes_per_pull,
            bytes_pushed_per_window=bytes_per_push,
            bytes_pulled_per_sample=bytes_per_pull / samples_per_window
            if samples_per_window
            else 0.0,
            bytes_pushed_per_sample=bytes_per_push / samples_per_window
            if samples_per_window
            else 0.0,
        )
