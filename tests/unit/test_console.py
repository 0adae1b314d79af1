"""What `print(strategy.model_stats(model))` shows: a short summary, not arrays."""

import numpy as np

import tf_asgd


def test_async_stats_repr_is_a_short_summary():
    hist = np.zeros(256, np.int64)
    hist[:3] = [15, 13, 2]
    stats = tf_asgd.AsyncStats(30, 30, 17 / 30, 2, 0, 0, 4_593_840, 4_593_840, hist)
    text = repr(stats)
    assert len(text.splitlines()) <= 4, text
    assert "array" not in text and len(text) < 300, text
    for part in ("windows=30", "applied=30", "dropped_stale=0", "dropped_nonfinite=0"):
        assert part in text
    assert "mean 0.57 max 2" in text and "{0: 15, 1: 13, 2: 2}" in text
    assert "4.6 MB" in text
    # The attributes stay as they are.
    assert stats.staleness_histogram is hist and stats.mean_staleness == 17 / 30
