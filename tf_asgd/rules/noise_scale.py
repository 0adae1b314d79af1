"""The gradient noise scale, read from N workers' windows (McCandlish et al. 2018).

The simple noise scale `B_simple = tr(Sigma) / |G|^2` is the batch beyond which larger
batches stop paying about linearly (arXiv:1812.06162, appendix A). It is estimated from
squared norms at two batch sizes, `b < B`:

    |G|^2     ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

A synchronous round gives both: each window's displacement (`b` = one window) and the
mean of its N windows (`B` = N). The two are averaged over rounds before their ratio is
taken, as the paper does. In windows, `B_simple` is how many workers a round can average
before another one stops paying almost linearly.
"""

import math

import numpy as np


def squared_norms(windows):
    """`(mean |d_i|^2, |mean d_i|^2)` of a round's N displacements (an `N x ...` array)."""
    flat = np.asarray(windows, dtype=np.float64).reshape(len(windows), -1)
    return float(np.mean(np.sum(flat**2, axis=1))), float(np.sum(np.mean(flat, axis=0) ** 2))


def round_estimates(small_sq, large_sq, workers):
    """Unbiased `(|G|^2, tr(Sigma))` from one round, in units of one window.

    Args:
        small_sq: the mean squared norm of one window's displacement (batch `b` = 1 window).
        large_sq: the squared norm of the mean of `workers` windows (batch `B` = N windows).
        workers: N, at least 2.

    Returns:
        `(signal, noise)`: estimates of `|G|^2` and `tr(Sigma)` (either may be negative
        for one round; only their averages over rounds are meaningful).
    """
    n = float(workers)
    if n < 2:
        raise ValueError(f"The noise scale needs at least 2 windows a round, got {workers}.")
    signal = (n * large_sq - small_sq) / (n - 1.0)
    noise = (small_sq - large_sq) / (1.0 - 1.0 / n)
    return signal, noise


def from_sums(push_sq, round_sq, workers):
    """The simple noise scale, in windows, from sums over whole rounds.

    What the PS accumulates (`outer.NOISE_SUMS`): the squared norms of every push
    of some rounds, and of each round's sum of pushes. Averaged per round, these are
    `N * small` and `N^2 * large` of `round_estimates`; the number of rounds cancels
    in the ratio.

    Args:
        push_sq: the sum of the pushes' squared norms over the rounds.
        round_sq: the sum, over the same rounds, of the squared norm of each round's
            sum of N pushes.
        workers: N, the pushes a round, at least 2.

    Returns:
        `tr(Sigma) / |G|^2` in windows: `nan` where no push was summed, `inf` where
        the signal estimate is not positive (the pushes agree less than noise would).

    Examples:
        >>> from_sums(8.0, 32.0, 4)  # 4 equal pushes of norm 1 a round: no noise
        0.0
        >>> from_sums(8.0, 8.0, 4)  # sums no larger than the parts: all noise
        inf
    """
    if not push_sq:
        return float("nan")
    signal, noise = round_estimates(push_sq / workers, round_sq / workers**2, workers)
    return noise / signal if signal > 0 else float("inf")


def workers_that_pay(noise_scale):
    """How many workers pay about linearly: the noise scale in windows, rounded, at least 1.

    At N workers a round's rounds to a target fall by `(1 + B) / (1 + B / N)` against
    one worker (McCandlish et al.'s model, `B` the noise scale in windows): close to N
    while `N << B`, half of N at `N = B`, and little more beyond. `None` where the noise
    scale is not a finite number.

    Examples:
        >>> workers_that_pay(5.4), workers_that_pay(0.2), workers_that_pay(float("inf"))
        (5, 1, None)
    """
    if not math.isfinite(noise_scale):
        return None
    return max(1, int(round(noise_scale)))


def round_gain(noise_scale, workers):
    """The step of a round of N windows, over one window's: `(1 + B) / (1 + B / N)`.

    McCandlish et al.'s best rate at batch `b` is `eps_max / (1 + B / b)` (`B` the
    noise scale); from one window to N it grows by this ratio: about N while the
    windows are mostly noise (`B >> N`, the linear scaling rule), about 1 where they
    agree (`B << 1`: averaging). Measured as a round's gain and not chosen: slower than
    the synchronous default's N (docs/defaults.md).

    Args:
        noise_scale: `B`, in windows (`nan`: not measured yet, gain 1; `inf`: N).
        workers: N.

    Examples:
        >>> round_gain(4.0, 8), round_gain(float("inf"), 8), round_gain(float("nan"), 8)
        (3.3333333333333335, 8.0, 1.0)
    """
    if math.isnan(noise_scale):
        return 1.0
    if math.isinf(noise_scale):
        return float(workers)
    b = max(0.0, noise_scale)
    return (1.0 + b) / (1.0 + b / workers)


class NoiseScale:
    """A running estimate of the simple noise scale, in windows (McCandlish et al. 2018).

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> estimate = NoiseScale()
        >>> for _ in range(2000):  # signal 1 in each of 4 dims, noise variance 2 per dim
        ...     _ = estimate.update(1.0 + rng.normal(scale=np.sqrt(2.0), size=(8, 4)))
        >>> round(estimate.value, 1)  # tr(Sigma) / |G|^2 = 8 / 4
        2.0

    Args:
        decay: the exponential moving average's decay per round (0: the plain mean of
            every round so far).

    Attributes:
        value: `tr(Sigma) / |G|^2` of the averages so far, in windows (`inf` while the
            averaged signal is not positive, `nan` before the first round).
        rounds: rounds seen.
    """

    def __init__(self, decay=0.0):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}.")
        self.decay, self.rounds = decay, 0
        self._signal = self._noise = 0.0

    def update(self, windows):
        """Adds one round: the N displacements of windows that started from the same weights.

        Returns:
            The updated `value`.
        """
        signal, noise = round_estimates(*squared_norms(windows), len(windows))
        self.rounds += 1
        weight = 1.0 / self.rounds if self.decay == 0.0 else 1.0 - self.decay
        if self.rounds == 1:
            weight = 1.0
        self._signal += weight * (signal - self._signal)
        self._noise += weight * (noise - self._noise)
        return self.value

    @property
    def value(self):
        if not self.rounds:
            return float("nan")
        return self._noise / self._signal if self._signal > 0 else float("inf")
