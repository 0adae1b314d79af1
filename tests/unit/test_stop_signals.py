"""The launcher's Ctrl-C / SIGTERM handling (`StopSignals`): where a signal's KeyboardInterrupt
is raised, and that none is lost. Real signals, sent to this process, during a real Keras fit."""

import os
import signal
import threading
import time
import traceback

import keras
import numpy as np
import pytest

from tf_asgd.launch import run_parts


def _model(layer=None):
    model = keras.Sequential(
        [keras.Input((4,)), *([layer] if layer else []), keras.layers.Dense(2)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)


def _raised_in(error):
    return traceback.extract_tb(error.__traceback__)[-1].name


class SignalInCall(keras.layers.Layer):
    """Once armed, sends SIGTERM to this process at its next call: in `fit`, while
    TensorFlow traces the train step."""

    armed = sent = False

    def call(self, x):
        if SignalInCall.armed and not SignalInCall.sent:
            SignalInCall.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, inside TF's tracing
        return x


def test_a_signal_inside_tensorflow_is_raised_at_the_next_batch_not_where_it_came():
    """An exception raised inside TF's tracing (Python called from its C++) can leave a NULL
    result behind (SystemError, a model that no longer builds, a segfault): the signal is
    recorded there and raised by the next check, after the batch."""
    x, y = _data()
    model = _model(SignalInCall())
    SignalInCall.armed = True
    with run_parts.StopSignals(timeout=0) as stop:
        with pytest.raises(KeyboardInterrupt) as raised:
            model.fit(x, y, epochs=2, verbose=0, callbacks=[run_parts.InterruptCallback(stop)])
    assert SignalInCall.sent and stop.signum == signal.SIGTERM
    assert _raised_in(raised.value) == "check"
    assert int(model.optimizer.iterations.numpy()) == 1  # the batch in flight finished
    # TF's state is whole: the same model trains on.
    model.fit(x, y, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3


class WaitOnBatchEnd(keras.callbacks.Callback):
    """Waits on an Event (as the chief waits for its windows) that is never set."""

    def on_train_batch_end(self, batch, logs=None):
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        threading.Event().wait(30)


def test_a_signal_while_the_main_thread_waits_in_fit_is_raised_at_once():
    x, y = _data()
    with run_parts.StopSignals(timeout=0) as stop:
        t0 = time.time()
        with pytest.raises(KeyboardInterrupt) as raised:
            _model().fit(x, y, epochs=1, verbose=0, callbacks=[WaitOnBatchEnd()])
    secs = time.time() - t0
    assert stop.requested.is_set() and _raised_in(raised.value) == "_handle"
    assert secs < 10, f"the wait was not interrupted: {secs:.1f} s"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost raise
def test_stop_signals_raise_again_after_a_lost_keyboard_interrupt():
    """A KeyboardInterrupt raised inside a finalizer is printed and dropped by
    Python; StopSignals remembers the signal and raises at the next check."""

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in here: lost
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)
    with run_parts.StopSignals(timeout=0) as stop:
        Finalizer()  # freed at once: "Exception ignored in ... Finalizer.__del__"
        assert stop.requested.is_set()
        with pytest.raises(KeyboardInterrupt):
            run_parts.InterruptCallback(stop).on_train_batch_end(0)
    assert stop.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


_HELD_IN_C = """
from tf_asgd.launch import run_parts
with run_parts.StopSignals(timeout=1.0):
    print("ready", flush=True)
    sum(range(10**12))  # C that holds the GIL for minutes: no Python handler runs
"""


def test_a_signal_while_the_main_thread_is_held_in_c_ends_the_process_within_the_bound(
    tmp_path,
):
    """Python's handler runs only once the main thread is back in Python; a main thread
    held in C (as in TF's C++, reading from a stopped PS) never gets there, and SIGTERM
    was ignored. The signal reaches the watchdog process through the wakeup fd, which
    aborts the process `WATCHDOG_GRACE_S` after the bound: no process is left."""
    import subprocess
    import sys

    script = tmp_path / "held.py"
    script.write_text(_HELD_IN_C)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.5)  # inside the sum
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()
    took = time.monotonic() - start
    assert proc.returncode in (-signal.SIGABRT, -signal.SIGKILL), proc.returncode
    assert 1.0 + run_parts.WATCHDOG_GRACE_S <= took < 1.0 + run_parts.WATCHDOG_GRACE_S + 8


def test_stop_signals_leave_no_watchdog_behind():
    """The watchdog process exits with the block."""
    with run_parts.StopSignals(timeout=5.0) as stop:
        watchdog = stop._watchdog  # (private: the test looks at the process)
        assert watchdog is not None and watchdog.poll() is None
    assert watchdog.wait(timeout=5) == 0
    assert signal.set_wakeup_fd(-1) == -1  # the previous wakeup fd is back
