"""What the console shows: `print(strategy.model_stats(model))` as a short summary, and
native stderr without TensorFlow's start-up lines."""

import os

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


def test_filtered_stderr_drops_tf_start_up_lines_and_shows_the_rest(capfd):
    from tf_asgd.cluster.tf_startup import filtered_stderr

    with filtered_stderr():
        os.write(2, b"I0000 00:00 1 port.cc:153] oneDNN custom operations are on. You may\n")
        os.write(2, b"W0000 something the user must see\n")
        os.write(2, b"I0000 00:00 1 cudart_stub.cc:31] Could not find cuda drivers on your\n")
    err = capfd.readouterr().err
    assert err == "W0000 something the user must see\n"
