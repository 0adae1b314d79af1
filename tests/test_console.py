"""The console: what the launcher and a `fit` print, and the repr of `AsyncStats`."""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import tf_asgd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# TF's start-up lines, and error lines of TF's C++ (absl's `E0000`) or Python logs.
_TF_NOISE = re.compile(
    r"absl::InitializeLog|oneDNN custom operations|cudart_stub|cpu_feature_guard|"
    r"cuInit|grpc_server_lib|^E0000|^E\d{4} | E tensorflow|^INFO:tensorflow|Traceback",
    re.MULTILINE,
)


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


class _BatchEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []  # per epoch: [(batch, logs), ...]

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append((batch, dict(logs or {})))


@pytest.mark.cluster
def test_progress_counts_the_epochs_steps_and_shows_no_placeholder(cluster, digits, capsys):
    """45 steps an epoch at n_sync 10: batch ends at steps 9, 19, 29, 39 and 44 (Keras's
    own index would say 49), and logs only once a window finished, with real values.
    Keras's progress bar, which prints what it is given, says the same."""
    (x, y), _ = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    ends = _BatchEnds()
    capsys.readouterr()
    model.fit(x, y, batch_size=32, epochs=2, verbose=1, callbacks=[ends])
    out = capsys.readouterr().out
    steps = -(-len(x) // 32)
    assert steps == 45
    for epoch in ends.epochs:
        batches = [b for b, _ in epoch]
        assert batches == [9, 19, 29, 39, 44], batches
        for _, logs in epoch:
            if logs:
                assert logs["loss"] > 0 and logs["accuracy"] > 0, logs
                assert all(v != 0 for k, v in logs.items() if k != "windows"), logs
        assert epoch[-1][1], "the epoch's last batch end has the epoch's metrics"
    shown = [int(n) for n in re.findall(r"(\d+)/45\b", out)]
    assert shown and max(shown) == 45, out
    assert "0.0000e+00" not in out, out


@pytest.mark.cluster
def test_launcher_default_run_prints_each_epoch_once_and_no_tf_noise(tmp_path):
    """The README's first command, shortened to 3 epochs of 10 steps, with TF's log
    level left to the launcher: one line per epoch (the launcher's, not Keras's too),
    no TF start-up line from the chief or its tasks, no error line."""
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    cmd = [
        sys.executable,
        "-m",
        "tf_asgd.launch",
        "--config=configs/default.py",
        "--config.epochs=3",
        "--config.steps_per_epoch=10",
        f"--workdir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    noise = sorted({m.group(0) for m in _TF_NOISE.finditer(out)})
    assert not noise, f"{noise} in:\n{out[-4000:]}"
    epoch_lines = [line for line in out.splitlines() if re.search(r"\b[Ee]poch \d+/3\b", line)]
    assert len(epoch_lines) == 3, epoch_lines
    for k in (1, 2, 3):
        assert sum(f"epoch {k}/3 done" in line for line in epoch_lines) == 1, epoch_lines
    assert not re.search(r"^\s*10/10 ", out, re.MULTILINE), "Keras's line as well"
    assert not re.search(r"^W\d{4} .*keras_hook", out, re.MULTILINE), "a warning on a clean run"
    assert "done: test accuracy" in out
