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
