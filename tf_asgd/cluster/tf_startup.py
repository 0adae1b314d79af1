"""TensorFlow's start-up, quietly: the TF import, and stderr without TF's start-up lines.

Every TF process writes notes to stderr while it starts (absl's pre-initialisation notice,
oneDNN, CPU features, a failed GPU probe), before `TF_CPP_MIN_LOG_LEVEL` applies.
`quiet_tf_startup` and `python_command` (a process started quietly) hold them back and
show everything else; `filtered_stderr` does it through a filter process (`import
tf_asgd`). `VERBOSE_TF_ENV` turns all of this off.

Example:
    with tf_startup.quiet_tf_startup():
        import tensorflow as tf
"""

import contextlib
import ctypes
import importlib.abc
import importlib.machinery
import os
import re
import subprocess
import sys
import tempfile

from tf_asgd.cluster import task_forks

# "1": processes started by tf_asgd show TensorFlow's start-up logs (the
# launcher's --verbose_tf sets it); otherwise they start quietly.
VERBOSE_TF_ENV = "TF_ASGD_VERBOSE_TF"

# What every TF 2.21 process writes to stderr while it starts (absl's
# pre-initialisation notice, the oneDNN and CPU-feature notes: written before
# absl's log is set up, so TF_CPP_MIN_LOG_LEVEL does not hide them), the
# chief's own gRPC server's address when it connects, and, on a machine
# without a CUDA driver, the failed GPU probe. Nothing else is dropped.
_STARTUP_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called|"
    r"port\.cc:\d+\] oneDNN custom operations are on|"
    r"grpc_server_lib\.cc:\d+\] Started server with target: |"
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
    r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized|"
    r"^To enable the following instructions: .* rebuild TensorFlow"
)
_FAILED_CUINIT = re.compile(r"cuda_platform\.cc:\d+\] failed call to cuInit")

# Runs a module (argv[1]) with TensorFlow imported and its devices listed
# while native stderr goes to a file, then shows that output without the
# start-up noise (`startup_log_to_show`); on a failure, all of it.
_QUIET_BOOT = "exec(%r)" % (  # one line (`ps` shows lines)
    "import os,sys,tempfile,runpy\n"
    "f=tempfile.TemporaryFile();e=os.dup(2);os.dup2(f.fileno(),2);ok=False\n"
    "try:\n"
    " import tf_asgd.cluster.tf_startup as c\n"
    " c.boot_tensorflow(sys.argv[1:]);ok=True\n"
    "finally:\n"
    " os.dup2(e,2);os.close(e);f.seek(0);t=f.read().decode(errors='replace');f.close()\n"
    " sys.stderr.write(c.startup_log_to_show(t) if ok else t);sys.stderr.flush()\n"
    "sys.argv=sys.argv[1:];runpy.run_module(sys.argv[0],run_name='__main__',alter_sys=True)\n"
)

TASK_SERVER = "tf_asgd.cluster.task_server"  # the module a LocalCluster's tasks run

# Processes that only serve TF graphs: TensorFlow starts there without Keras.
SERVER_MODULES = (TASK_SERVER,)


class _NoKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `keras` where it is installed (TF looks up its directory) but
    refuses to load it (TF then skips its eager import of Keras)."""

    def find_spec(self, name, path, target=None):
        if name != "keras":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec):
        raise ImportError("Keras is not loaded in a process that only serves TF graphs")

    def exec_module(self, module):
        raise ImportError("Keras is not loaded in a process that only serves TF graphs")


def import_tensorflow(module=None):
    """Imports and returns TensorFlow for a process that runs `module`.

    For a task server (`SERVER_MODULES`), without Keras: TF imports Keras's
    optimizers eagerly, to register them for SavedModel loading, which a
    server never does; that import is about a third of a task's start-up CPU.
    Where Keras or TF is loaded already, this only imports TF.
    """
    if module not in SERVER_MODULES or "keras" in sys.modules or "tensorflow" in sys.modules:
        import tensorflow

        return tensorflow
    blocker = _NoKeras()
    sys.meta_path.insert(0, blocker)
    try:
        import tensorflow
    finally:
        sys.meta_path.remove(blocker)
    return tensorflow


def boot_tensorflow(argv):
    """What a quiet start runs before the module `argv[0]`: imports TensorFlow
    and lists its devices (which loads the GPU libraries) while stderr is muted.
    A fork server (`task_forks`) lists none: CUDA is not fork-safe once
    initialised, and each task it forks lists its own."""
    tf = import_tensorflow(argv[0])
    if task_forks.FORKS not in argv:
        tf.config.list_physical_devices()


def verbose_tf():
    """Whether TF's start-up logs are wanted (`VERBOSE_TF_ENV` is "1")."""
    return os.environ.get(VERBOSE_TF_ENV) == "1"


def python_command(module, args=()):
    """`python -m module args`, started quietly unless `verbose_tf()`: TF's
    start-up lines are dropped (`startup_log_to_show`), all else is shown."""
    if verbose_tf():
        return [sys.executable, "-m", module, *args]
    # The module's name first, so that a narrow `ps` shows it, as with `-m`.
    return [sys.executable, "-c", f"{module!r};{_QUIET_BOOT}", module, *args]


def startup_log_to_show(text):
    """`text` (what native code wrote to stderr while TF started) without the
    start-up noise. A failed cuInit is noise only where there is no CUDA
    driver (no GPU could be used anyway); with a driver it is shown."""
    no_driver = not _cuda_driver_present()
    kept = [
        line
        for line in text.splitlines(keepends=True)
        if not _STARTUP_NOISE.search(line) and not (no_driver and _FAILED_CUINIT.search(line))
    ]
    return "".join(kept)


def _cuda_driver_present():
    """Whether the CUDA driver library (libcuda) can be loaded."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def quiet_tf_startup(enabled=True):
    """While the block runs (import TensorFlow, list its devices), what native
    code writes to stderr (fd 2) goes to a file; afterwards it is written to
    stderr without the start-up noise (everything, if the block raised)."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()  # what Python wrote meanwhile goes to the file too
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            sys.stderr.write(startup_log_to_show(text) if ok else text)
            sys.stderr.flush()


@contextlib.contextmanager
def one_tf_log_handler():
    """While the block runs (connecting to the cluster), TF's own modules may call
    `logging.basicConfig()` through absl, which gives the root logger a handler. TF's
    logger, which has a handler of its own when TF was imported before any logging set-up,
    then prints each record twice. Where the block added the root's handler, TF's own
    handler is removed afterwards: each record is printed once, by the root's handler."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        if not before and root.handlers:
            tf_logger = logging.getLogger("tensorflow")
            for handler in list(tf_logger.handlers):
                tf_logger.removeHandler(handler)


# Copies stdin to stderr line by line, without the lines matching argv[1].
_FILTER = (
    "import re,sys\n"
    "p=re.compile(sys.argv[1],re.M)\n"
    "for line in sys.stdin.buffer:\n"
    " t=line.decode(errors='replace')\n"
    " if not p.search(t):sys.stderr.write(t);sys.stderr.flush()\n"
)


@contextlib.contextmanager
def filtered_stderr():
    """While the block runs, native stderr (fd 2) passes through a filter process that
    drops TF's start-up lines (`_STARTUP_NOISE`) and shows every other line as it comes.

    The filter is a separate process, so a fatal message (TF aborting at import on a CPU
    it was not built for) still reaches the terminal: the filter reads to the end of the
    pipe even after this process is gone. Where the filter cannot start, nothing is
    filtered.
    """
    sys.stderr.flush()
    try:
        filt = subprocess.Popen(
            [sys.executable, "-S", "-c", _FILTER, _STARTUP_NOISE.pattern], stdin=subprocess.PIPE
        )
    except OSError:
        yield
        return
    saved = os.dup(2)
    os.dup2(filt.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        filt.stdin.close()
        try:
            filt.wait(timeout=10)
        except subprocess.TimeoutExpired:
            filt.kill()
            filt.wait()
