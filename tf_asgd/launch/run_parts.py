"""The parts of a run the task roles (`tf_asgd.launch.roles`) build from a config.

- builders: `make_model`, `make_optimizer`, `make_outer_optimizer`, `compile_model`;
- callbacks: `make_progress_callback` (throughput log lines),
  `make_checkpoint_callback` (a checkpoint per epoch), `save_checkpoint`,
  `make_checkpoint`;
- stopping: `StopSignals` (Ctrl-C / SIGTERM as a KeyboardInterrupt that is
  never lost, with a bound on how long stopping takes), `InterruptCallback`,
  `checkpoint_on_interrupt` (a checkpoint on Ctrl-C / SIGTERM); a lost task
  is named by `lost_tasks`;
- `configure_tf_python_logging`: TF's Python log records once, at WARNING.
"""

import faulthandler
import importlib.util
import logging as py_logging
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import tensorflow as tf
from absl import logging

from tf_asgd import internals, models, optimizers
from tf_asgd.launch.config_fields import MODELS
from tf_asgd.rules import outer_optimizers

DONE_FILE = "DONE"


# ---------------------------------------------------------------------------
# Builders


def make_model(config):
    """The Keras model named by `config.model` (a builder in `tf_asgd.models`)."""
    if config.model not in MODELS:
        raise ValueError(f"Unknown model {config.model!r}; expected one of {MODELS}.")
    builder = getattr(models, config.model)
    if config.model == "cuda_convnet_cifar10":
        crop = config.crop_size or 24
        return builder(input_shape=(crop, crop, 3))
    if config.model == "paine2013_imagenet_convnet":
        crop = config.crop_size or 224
        return builder(input_shape=(crop, crop, 3))
    if config.model == "gem_mnist_convnet" and config.dataset != "mnist":
        raise ValueError(
            f"Model gem_mnist_convnet needs MNIST's 28x28 images; dataset {config.dataset!r} "
            "does not have them. Use --config.dataset=mnist, or --config.model=digits_convnet "
            "for the 8x8 digits."
        )
    return builder()


def make_optimizer(config):
    """`config.optimizer` as a Keras optimizer, wrapped in GEM when `config.gem.enabled`."""
    o = config.optimizer
    if o.name == "sgd":
        opt = keras.optimizers.SGD(o.learning_rate, momentum=o.momentum)
    elif o.name == "adam":
        opt = keras.optimizers.Adam(o.learning_rate)
    else:
        raise ValueError(f"Unknown optimizer {o.name!r}; expected 'sgd' or 'adam'.")
    if config.gem.enabled:
        opt = optimizers.GEM(opt, kappa=config.gem.kappa)
    return opt


OUTER_OPTIMIZERS = ("default", "sgd", "nesterov", "delayed_nesterov")


def make_outer_optimizer(config):
    """`config.outer` as an outer optimizer for the strategy (None: its default).

    Raises:
        ValueError: for an unknown `outer.name`.
    """
    o = config.outer
    if o.name == "default":
        return None
    if o.name == "sgd":
        return outer_optimizers.OuterSGD(o.learning_rate or 1.0, momentum=o.momentum)
    if o.name == "nesterov":
        return outer_optimizers.OuterSGD(o.learning_rate or 0.7, momentum=o.momentum, nesterov=True)
    if o.name == "delayed_nesterov":
        return outer_optimizers.DelayedNesterov(o.learning_rate or 0.7, momentum=o.momentum)
    raise ValueError(
        f"Unknown outer optimizer {o.name!r}; expected one of {', '.join(OUTER_OPTIMIZERS)}."
    )


def compile_model(model, config):
    """Compiles `model` with `make_optimizer(config)`, sparse categorical
    cross-entropy on logits, and accuracy."""
    model.compile(
        make_optimizer(config),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def fit_verbosity(config):
    """Keras's `fit` verbosity: `config.verbose`, or for -1: a progress bar on a
    terminal, else 0 (the `ProgressCallback`'s line per epoch, not Keras's too)."""
    if config.verbose >= 0:
        return config.verbose
    return 1 if sys.stdout.isatty() else 0


def tensorboard_available():
    """Whether `tf.summary` can write (the `tensorboard` package is installed)."""
    return importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------
# Callbacks and checkpoints


class ProgressCallback(keras.callbacks.Callback):
    """Adds `samples_per_sec` to the epoch logs. Where Keras prints nothing
    (`fit`'s verbose 0), it logs a line per epoch and a progress line every
    `config.log_every_secs` (0: never); otherwise Keras's progress is the one
    shown."""

    # Its batch-level method knows it runs once per window (see keras_hook).
    _tf_asgd_runs_per_window = True

    def __init__(self, config, batch_size):
        super().__init__()
        self._config, self._batch_size = config, batch_size

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._t0 = self._last = time.time()

    def on_train_batch_end(self, batch, logs=None):
        every = self._config.log_every_secs
        now = time.time()
        if self.params.get("verbose") or not every or now - self._last < every:
            return
        self._last = now
        logs = logs or {}
        steps = batch + 1
        logging.info(
            "epoch %d/%d step %d/%s: %.0f samples/s, loss %.4f, staleness %.2f, windows %d",
            self._epoch + 1,
            self.params.get("epochs"),
            steps,
            self.params.get("steps"),
            steps * self._batch_size / max(now - self._t0, 1e-9),
            logs.get("loss", float("nan")),
            logs.get("staleness", 0.0),
            int(logs.get("windows", 0)),
        )

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            steps = self.params.get("steps") or 0
            logs["samples_per_sec"] = steps * self._batch_size / max(time.time() - self._t0, 1e-9)
            if self.params.get("verbose"):
                return  # Keras prints the epoch's line
            logging.info(
                "epoch %d/%d done: %s",
                epoch + 1,
                self.params.get("epochs"),
                ", ".join(f"{k} {v:.4g}" for k, v in sorted(logs.items())),
            )


def make_progress_callback(config, batch_size):
    """A `ProgressCallback` for `config` at `batch_size` examples per step."""
    return ProgressCallback(config, batch_size)


class CheckpointCallback(keras.callbacks.Callback):
    """Saves a checkpoint after every epoch, with the epochs done inside."""

    def __init__(self, manager, epoch_var, step_fn):
        super().__init__()
        self._manager, self._epoch_var, self._step_fn = manager, epoch_var, step_fn

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_var.assign(epoch + 1)
        save_checkpoint(self._manager, self._step_fn(), f"epoch {epoch + 1}")


def make_checkpoint_callback(manager, epoch_var, step_fn):
    """A `CheckpointCallback`: `manager` saves, `epoch_var` counts epochs,
    `step_fn()` gives the optimizer's global step (the checkpoint number)."""
    return CheckpointCallback(manager, epoch_var, step_fn)


def make_checkpoint(model, strategy, epoch_var):
    """A `tf.train.Checkpoint` of the model (central variables), the epoch
    count, the optimizer once built, the strategy's push counters and its
    outer optimizer's state (restored when `fit` creates it).

    Its writes run one traced function (`internals.trace_checkpoint_writes`):
    TF would trace a new one per checkpoint, registering it on every task of
    the cluster and warning about retracing. Build the optimizer first.
    """
    parts = {"model": model, "epoch": epoch_var}
    if model.optimizer is not None and model.optimizer.built:
        parts["optimizer"] = model.optimizer
    if strategy is not None:
        parts["counters"] = strategy.counters
        parts["outer"] = strategy.outer_state(model)
    return internals.trace_checkpoint_writes(tf.train.Checkpoint(**parts))


def save_checkpoint(manager, step, reason, log=logging.info):
    """Saves `checkpoints/ckpt-STEP` (STEP: the optimizer's global step) unless
    the newest checkpoint already has that step, and says so with `log`.
    Returns the path or None.

    `tf.train.CheckpointManager` writes the files under temporary names and
    renames them, then rewrites the `checkpoint` state file atomically, so
    `tf.train.latest_checkpoint` (what `--resume` reads) only ever names a
    complete checkpoint.
    """
    latest = manager.latest_checkpoint
    if latest and latest.endswith(f"-{step}"):
        return None
    path = manager.save(checkpoint_number=step)
    log("saved checkpoint %s (%s)", path, reason)
    return path


# ---------------------------------------------------------------------------
# Stopping: signals, interrupts, lost tasks


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM as a KeyboardInterrupt that is never lost,
    and never raised where it could corrupt TensorFlow, with a bound on how
    long stopping may take.

    Python raises a signal's exception in whatever Python code the main
    thread runs next. Inside TensorFlow or Keras that is unsafe: their C++
    calls back into Python (tracing, `tf.cond`, `nest`), and an exception it
    does not expect there leaves it with a NULL result (`SystemError`, a
    strategy whose every later `fit` fails, or a segfault). In a finalizer
    (`__del__`) the exception is dropped. So the handler raises only where
    the main thread waits in Python's `threading` (the chief's waits for its
    windows) or runs with no TensorFlow or Keras frame on its stack; anywhere
    else it sets `requested`, and `check()` (run by `InterruptCallback` after
    every batch and epoch) raises.

    The first signal also arms a hard deadline: if stopping (the last
    windows, the checkpoint, stopping the local cluster) has not ended the
    process after `timeout` seconds, `faulthandler` (a C thread: it needs no
    GIL, so it fires even while TF's C++ holds it) prints every thread's
    stack and exits with status 1; a local cluster's tasks follow (their
    stdin lifeline). Further signals while stopping are logged and ignored.
    The handler that arms it is Python's, which runs only once the main thread
    is back in Python; a main thread held inside TF's C++ (a read from a PS that
    was stopped) never gets there. So the signal also reaches a watchdog process
    through Python's wakeup fd, which C writes at once: `WATCHDOG_GRACE_S` after
    `timeout` it aborts this process (SIGABRT: `faulthandler` prints the stacks),
    then kills it.
    A SIGINT that was ignored when the process started (a background job of
    a non-interactive shell, nohup) stays ignored, as Python itself does.

    Use as a context manager in the main thread (elsewhere it installs
    nothing); `exit_code` is 128 + the signal number (130 for Ctrl-C).
    """

    def __init__(self, timeout=60.0):
        self.timeout = timeout
        self.requested = threading.Event()
        self.signum = None
        self._previous = {}
        self._watchdog = self._wakeup = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.timeout and self._previous:
                self._start_watchdog()
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._watchdog is not None:
            signal.set_wakeup_fd(self._wakeup[1])
            _watched_fds.discard(self._wakeup[0])
            os.close(self._wakeup[0])  # a watchdog still reading exits on this
            try:
                self._watchdog.wait(timeout=2)
            except subprocess.TimeoutExpired:  # armed by a signal: stopping reached its end
                self._watchdog.kill()
                self._watchdog.wait(timeout=5)
            self._watchdog = None

    def _start_watchdog(self):
        read, write = os.pipe()
        os.set_blocking(write, False)
        deadline = self.timeout + WATCHDOG_GRACE_S
        signals = f"{int(signal.SIGINT)},{int(signal.SIGTERM)}"
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(deadline), signals],
                stdin=read,
                close_fds=True,
            )
        except OSError:  # no watchdog: Python's own deadline only
            os.close(read), os.close(write)
            return
        os.close(read)
        self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        _watched_fds.add(write)

    def _handle(self, signum, frame):
        if self.requested.is_set():
            logging.warning("signal %d: already stopping (within %.0f s)", signum, self.timeout)
            return
        self.signum = signum
        self.requested.set()
        if self.timeout:
            faulthandler.dump_traceback_later(self.timeout, exit=True)
        if safe_to_interrupt(frame):
            raise KeyboardInterrupt(f"signal {signum}")

    def check(self):
        """Raises KeyboardInterrupt if a signal came (deferred, or its first raise lost)."""
        if self.requested.is_set():
            raise KeyboardInterrupt(f"signal {self.signum}")

    @property
    def exit_code(self):
        return 128 + (self.signum or signal.SIGINT)


# After `StopSignals.timeout`, the watchdog waits this long for Python's own deadline.
WATCHDOG_GRACE_S = 5.0
# The watchdog: reads signal numbers from its stdin (the wakeup fd's pipe) until one of
# the stop signals; then aborts its parent where it has not exited by the deadline. An
# empty read is its parent's exit, or `StopSignals.__exit__`.
_WATCHDOG = """
import os, signal, sys, time
parent, deadline = int(sys.argv[1]), float(sys.argv[2])
stops = {int(n) for n in sys.argv[3].split(",")}
while True:
    data = os.read(0, 64)
    if not data:
        sys.exit(0)
    if any(b in stops for b in data):
        break
end = time.monotonic() + deadline
while time.monotonic() < end:
    time.sleep(0.2)
    if os.getppid() != parent:
        sys.exit(0)
for sig in (signal.SIGABRT, signal.SIGKILL):
    if os.getppid() != parent:
        sys.exit(0)
    os.kill(parent, sig)
    time.sleep(3.0)
"""

_watched_fds = set()  # the write ends of watchdogs' pipes this process holds


def _forget_watchdogs_in_child():
    """In a process forked from one that holds a watchdog (a local cluster's task): its
    signals must not reach its parent's watchdog."""
    if not _watched_fds:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread: the fd stays, and open
        return
    for fd in _watched_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _watched_fds.clear()


os.register_at_fork(after_in_child=_forget_watchdogs_in_child)

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (tf, keras))


def safe_to_interrupt(frame):
    """Whether an exception may be raised in `frame`, the main thread's
    innermost Python frame: a wait of Python's `threading` module, or code
    with no TensorFlow or Keras frame below it (see `StopSignals`)."""
    if frame is None or frame.f_code.co_filename == threading.__file__:
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
            return False
        frame = frame.f_back
    return True


class InterruptCallback(keras.callbacks.Callback):
    """Raises KeyboardInterrupt after a batch or epoch once `stop` (a
    `StopSignals`) got a signal that was not raised where it came, or whose
    KeyboardInterrupt was lost."""

    _tf_asgd_runs_per_window = True  # a check per window is often enough

    def __init__(self, stop):
        super().__init__()
        self._stop = stop

    def on_train_batch_end(self, batch, logs=None):
        self._stop.check()

    def on_test_batch_end(self, batch, logs=None):
        self._stop.check()

    def on_epoch_begin(self, epoch, logs=None):
        self._stop.check()

    def on_epoch_end(self, epoch, logs=None):
        self._stop.check()


class _DropLibraryInfo(py_logging.Filter):
    """Drops records below WARNING logged from code under `dirs`."""

    def __init__(self, dirs):
        super().__init__()
        self._dirs = tuple(dirs)

    def filter(self, record):
        return record.levelno >= py_logging.WARNING or not record.pathname.startswith(self._dirs)


def configure_tf_python_logging(verbose=False):
    """TF's and Keras's Python log records: WARNING and above (everything with
    `verbose`), each printed once, by absl's handler.

    TF adds a handler of its own to its logger when it is imported before
    absl sets logging up, so each record would be printed twice, in two
    formats; and some of TF's modules log INFO through absl directly (the
    session config on connecting, checkpoint sharding times), so the
    filter is on absl's handler, by the file that logged.
    """
    logger = tf.get_logger()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(py_logging.INFO if verbose else py_logging.WARNING)
    if not verbose:
        dirs = [os.path.dirname(m.__file__) + os.sep for m in (tf, keras)]
        logging.get_absl_handler().addFilter(_DropLibraryInfo(dirs))


def checkpoint_on_interrupt(manager, step_fn):
    """Saves a checkpoint of the central variables after Ctrl-C or SIGTERM.

    Windows already pushed are kept (the epoch count stays at the last epoch
    finished: `--resume` restarts that epoch with the trained weights).
    Further Ctrl-C/SIGTERM are ignored while it saves.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        if save_checkpoint(manager, step_fn(), "interrupted") is None:
            logging.info(
                "interrupted: the newest checkpoint %s already holds every pushed window",
                manager.latest_checkpoint,
            )
    except Exception as e:  # a dead PS: nothing to save; report and go on stopping
        logging.error("could not save a checkpoint on interrupt: %s", str(e).splitlines()[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
