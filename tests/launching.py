"""Starting the launcher as users do (`python -m tf_asgd.launch`), and checking it stopped."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from helpers import ROOT

SHORT = [
    "--config=configs/default.py",
    "--config.steps_per_epoch=20",
    "--config.validate_every_epoch=False",
    "--config.log_every_secs=0",
]


def launcher(args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)  # local runs; tests that need one set it
    return [sys.executable, "-m", "tf_asgd.launch", *args], env


def run_launcher(args, timeout=180, extra_env=None):
    cmd, env = launcher(args)
    env.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def _default_signals():
    # A process started with SIGINT ignored keeps ignoring it (POSIX; Python
    # then installs no KeyboardInterrupt handler). A non-interactive shell
    # starts its background jobs that way, so a test run from one would send
    # its "Ctrl-C" to a launcher that cannot hear it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_launcher(args, **popen_kwargs):
    """The launcher as a child that receives Ctrl-C like a terminal's foreground job."""
    cmd, env = launcher(args)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, text=True, preexec_fn=_default_signals, **popen_kwargs
    )


def local_cluster_ports(log):
    m = re.search(r"local cluster (\{.*?\}), processes", log)
    assert m, "the launcher did not log its local cluster"
    spec = json.loads(m.group(1))
    return [a.split(":")[1] for job in ("worker", "ps") for a in spec[job]]


def local_cluster_pids(log):
    """The process ids of the launcher's local cluster, from its log: each task
    process, and the process they were forked from (if any)."""
    m = re.search(r"local cluster \{.*?\}, processes (\{.*?\}), forked from (\w+)", log)
    assert m, "the launcher did not log its local cluster's processes"
    pids = [int(pid) for pid in re.findall(r"': (\d+)", m.group(1))]
    return pids + ([int(m.group(2))] if m.group(2) != "None" else [])


def parent_pid(pid):
    """The process id of `pid`'s parent process."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


def alive(pid):
    """Whether process `pid` runs: False once it is gone or a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_all_stopped(pids, within=15.0):
    """Every process in `pids` (`local_cluster_pids`) ends within `within` seconds."""
    deadline = time.time() + within
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)]


def before_module_list(err):
    """`err` without the list of extension modules that Python's faulthandler prints
    after the threads' stacks of a fatal error: the stacks then fit in a failure's tail."""
    return err.split("\nExtension modules:")[0]
