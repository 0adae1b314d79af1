"""The console: what a `fit` on the strategy reports to Keras's progress bar and callbacks
(the launcher's console: test_launch.py)."""

import os
import re
import signal
import subprocess
import sys

import keras

import tf_asgd

from helpers import ROOT

REAL_ZEROS = ("windows", "staleness")  # logs whose 0 is a value, not a placeholder


class _BatchEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []  # per epoch: [(batch, logs), ...]

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append((batch, dict(logs or {})))


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
                # (Mean staleness may truly be 0: windows that did not overlap.)
                assert all(v != 0 for k, v in logs.items() if k not in REAL_ZEROS), logs
        assert epoch[-1][1], "the epoch's last batch end has the epoch's metrics"
    shown = [int(n) for n in re.findall(r"(\d+)/45\b", out)]
    assert shown and max(shown) == 45, out
    zeros = set(re.findall(r"(\w+): 0\.0000e\+00", out))
    assert zeros <= set(REAL_ZEROS), out


def _python(code, *args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=dict(environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_importing_tf_asgd_first_loads_tensorflow_without_its_banners():
    code = "import tf_asgd, keras, sys; sys.stderr.write('imported\\n')"
    quiet, verbose = _python(code), _python(code, TF_ASGD_VERBOSE_TF="1")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert quiet.stderr == "imported\n", quiet.stderr
    assert "cpu_feature_guard" in verbose.stderr or "oneDNN" in verbose.stderr


def test_a_fatal_message_inside_the_filter_still_reaches_stderr():
    # Started the way a LocalCluster starts a task server (`python -c "'MODULE';..."
    # MODULE`), which tf_asgd imports without TensorFlow: the filter needs none.
    server = "tf_asgd.cluster.task_server"
    code = (
        f"{server!r};import os,sys\n"
        "from tf_asgd.cluster.tf_startup import filtered_stderr\n"
        "assert 'tensorflow' not in sys.modules\n"
        "with filtered_stderr():\n"
        "    os.write(2, b'F0000 fatal: this CPU lacks AVX\\n')\n"
        "    os.abort()\n"
    )
    proc = _python(code, server)
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert "F0000 fatal: this CPU lacks AVX" in proc.stderr


def test_a_task_server_starts_quietly_and_without_keras():
    """A LocalCluster's task process (`python_command`'s quiet start) loads TensorFlow
    alone: Keras, which TF would import for SavedModel registrations, is a third of a
    task's start-up CPU, and a server runs only graphs. It still starts without TF's
    banners."""
    from tf_asgd.cluster import tf_startup

    module = "tf_asgd.cluster.task_server"
    cmd = tf_startup.python_command(module)
    # The quiet start, with the module's run replaced by a report of what it loaded.
    boot = cmd[2].replace(
        "runpy.run_module(sys.argv[0],run_name='__main__',alter_sys=True)",
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'keras', 'tensorflow'}))",
    )
    assert boot != cmd[2]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run(
        [cmd[0], "-c", boot, *cmd[3:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "['tensorflow']", proc.stdout
    assert "cpu_feature_guard" not in proc.stderr and "oneDNN" not in proc.stderr, proc.stderr


def test_a_tensorflow_log_line_prints_once_after_connecting():
    # Connecting makes absl call `logging.basicConfig()`; TF's logger has its own handler
    # (TF imported before any logging set-up), so each record printed twice.
    code = (
        "import tf_asgd, tensorflow as tf\n"
        "with tf_asgd.LocalCluster(num_workers=1, num_ps=1) as cluster:\n"
        "    tf_asgd.AsyncParameterServerStrategy(cluster.resolver)\n"
        "    tf.get_logger().warning('a probe line')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("a probe line") == 1, proc.stderr[-3000:]
