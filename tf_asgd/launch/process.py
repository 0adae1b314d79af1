"""The launcher's process: from its parsed flags (`tf_asgd.launch.main`) to its exit.

`launch` reads `TF_CONFIG`, refuses a used workdir, moves a local run into its loopback-only
network namespace (`tf_asgd.cluster.network`), imports TensorFlow quietly, then runs this
process's role (`roles.run`) and exits saying why it stopped. Standard library and numpy
only until the run is in its namespace: a process that has loaded TensorFlow (seconds on a
small machine) would load it again after the re-exec.
"""

import contextlib
import os
import re
import sys

from absl import app, logging

from tf_asgd import data
from tf_asgd.cluster import network, task_server, tf_config, tf_startup
from tf_asgd.launch import config_fields


def launch(
    config,
    workdir,
    resume=False,
    gpus_per_worker=None,
    isolate_network="auto",
    bandwidth=None,
    verbose_tf=False,
    stop_timeout=60.0,
):
    """Runs this process's role, or exits saying why not (the launcher's flags, parsed).

    Args:
        config: the run's `ml_collections.ConfigDict` (`--config`).
        workdir: `--workdir`, or `None` (a worker or ps task).
        resume: `--resume`.
        gpus_per_worker: `--gpus_per_worker`: overrides `config.gpus_per_worker` unless `None`.
        isolate_network: `--isolate_network`: "auto", "yes" or "no".
        bandwidth: `--bandwidth`, or `None`.
        verbose_tf: `--verbose_tf`.
        stop_timeout: `--stop_timeout`.

    Raises:
        app.UsageError: flags that do not go together (absl prints the usage).
        SystemExit: a bad `TF_CONFIG`, a used workdir, a network that cannot be set up,
            a lost task, or a stop by Ctrl-C or SIGTERM (the message says which).
    """
    if gpus_per_worker is not None:
        config.gpus_per_worker = gpus_per_worker
    try:
        role = tf_config.tf_config_role()  # fails at once on a malformed TF_CONFIG
    except ValueError as e:
        sys.exit(f"tf_asgd.launch: bad TF_CONFIG: {e}")
    if workdir is None and (role is None or role[1] in ("chief", "evaluator")):
        raise app.UsageError("--workdir is required for local runs, the chief and the evaluator.")
    if not resume and (role is None or role[1] == "chief"):
        refuse_a_used_workdir(workdir)
    must_download = (
        config.dataset
        if config.download and data.needs_download(config.dataset, config.data_dir)
        else None
    )
    try:
        rate = network.check_bandwidth_request(
            bandwidth, isolate_network, local=role is None, must_download=must_download
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    except OSError as e:
        sys.exit(f"tf_asgd.launch: {e}")
    if role is None:
        set_up_local_network("yes" if rate else isolate_network, rate, must_download)
    # A local cluster's tasks are forked from a copy of this process, made once TF is
    # imported and before its runtime starts: one TensorFlow import for the whole run.
    forks = role is None and not config.gpus_per_worker
    with import_tf_quietly(verbose_tf, fork_server=forks):
        _train(config, workdir, resume, verbose_tf, stop_timeout)


def set_up_local_network(isolate, rate, must_download):
    """Moves this local run into its loopback-only namespace as `isolate` says
    (`network.isolate_local_run`) and limits its bandwidth to `rate` bits/s (`None`:
    no limit), or exits saying why not."""
    try:
        # Outside: does not return. Inside, TF starts quietly (see quiet_tf_startup).
        network.isolate_local_run(
            isolate, tf_startup.python_command("tf_asgd.launch", sys.argv[1:]), must_download
        )
    except OSError as e:
        sys.exit(f"tf_asgd.launch: --isolate_network=yes, but {e}.")
    if rate:
        try:
            network.limit_local_bandwidth(rate)
        except OSError as e:
            sys.exit(f"tf_asgd.launch: {e}")


def refuse_a_used_workdir(workdir):
    """Exits, saying why, if `workdir` holds a checkpoint: without `--resume` the run would
    write over it. Read from TF's `checkpoint` state file before TensorFlow is loaded, so
    the refusal is immediate (the chief checks again with TF)."""
    latest = _latest_checkpoint(workdir)
    if latest:
        sys.exit(f"tf_asgd.launch: {config_fields.used_workdir_message(workdir, latest)}")


def _latest_checkpoint(workdir):
    """The newest checkpoint's path in `workdir` (from TF's `checkpoint` state file), or
    None."""
    if not workdir:
        return None
    ckpt_dir = os.path.join(workdir, config_fields.CHECKPOINT_DIR)
    try:
        with open(os.path.join(ckpt_dir, "checkpoint")) as f:
            m = re.search(r'^model_checkpoint_path: "(.*)"$', f.read(), re.MULTILINE)
    except OSError:
        return None
    latest = m and os.path.join(ckpt_dir, m.group(1))
    return latest if latest and os.path.exists(latest + ".index") else None


def _train(config, workdir, resume, verbose_tf, stop_timeout):
    """Runs the role of this process (`roles.run`), or exits saying why it stopped."""
    from tf_asgd import errors, internals
    from tf_asgd.cluster import lost_tasks
    from tf_asgd.launch import roles, run_parts

    run_parts.configure_tf_python_logging(verbose_tf)
    role = tf_config.tf_config_role()
    if role is None or role[1] not in ("worker", "ps"):  # a server's config means nothing
        logging.info("config:\n%s", "\n".join(config_lines(config)))
    stop = run_parts.StopSignals(stop_timeout)
    try:
        roles.run(config, workdir and os.path.abspath(workdir), resume=resume, stop=stop)
    except (
        lost_tasks.ClusterTaskLostError,
        task_server.TaskServerError,
        errors.ClusterUnreachableError,  # WorkersLostError too
        errors.MissingDataError,
    ) as e:
        sys.exit(f"tf_asgd.launch: {e}")  # one line, once
    except KeyboardInterrupt:
        saved = _latest_checkpoint(workdir)
        logging.warning(
            "stopped by %s. %s",
            f"signal {stop.signum}" if stop.signum else "KeyboardInterrupt",
            "Rerun with --resume to continue from the newest checkpoint."
            if saved
            else "No checkpoint was saved yet: a rerun starts afresh.",
        )
        sys.exit(stop.exit_code)
    finally:
        # The process ends: no remote work follows, and freeing the chief's
        # tf.functions must not send an RPC to each (stopped) task.
        internals.stop_removing_functions_remotely()


def verbose_tf_requested(argv, environ=None):
    """`--verbose_tf` as absl would read it from `argv` (the last one wins), or
    the environment's `tf_startup.VERBOSE_TF_ENV`, before flags are parsed."""
    environ = os.environ if environ is None else environ
    verbose = environ.get(tf_startup.VERBOSE_TF_ENV) == "1"
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg in ("--verbose_tf", "--noverbose_tf"):
            verbose = arg == "--verbose_tf"
        elif arg.startswith("--verbose_tf="):
            verbose = arg.split("=", 1)[1].lower() in ("1", "true", "t", "yes", "y")
    return verbose


def set_tf_log_level(argv):
    """Before absl starts: TF's log level for this process and every process
    it starts (`TF_CPP_MIN_LOG_LEVEL`, `tf_startup.VERBOSE_TF_ENV`)."""
    if verbose_tf_requested(argv):
        os.environ[tf_startup.VERBOSE_TF_ENV] = "1"
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@contextlib.contextmanager
def import_tf_quietly(verbose, fork_server=False):
    """Imports TensorFlow and lists its devices while native stderr is held
    back (`tf_startup.quiet_tf_startup`: drops the start-up lines, shows
    anything else). With `fork_server`, in between, forks the fork server of
    the block's local clusters (`task_server.fork_server_from_here`)."""
    with tf_startup.quiet_tf_startup(not verbose):
        import tensorflow as tf
    with task_server.fork_server_from_here() if fork_server else contextlib.nullcontext():
        with tf_startup.quiet_tf_startup(not verbose):
            tf.config.list_physical_devices()
        yield


def config_lines(config, prefix=""):
    """`field: value` per leaf of `config`, dotted and sorted (`optimizer.momentum: 0.9`):
    each field on a line of its own, none repeated, as `--config.<field>` names it."""
    for key in sorted(config.keys()):
        value = config[key]
        if hasattr(value, "keys"):  # a nested ConfigDict
            yield from config_lines(value, f"{prefix}{key}.")
        else:
            yield (
                f"{prefix}{key}: {value!r}" if isinstance(value, str) else f"{prefix}{key}: {value}"
            )
