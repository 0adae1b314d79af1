"""Launcher: `python -m tf_asgd.launch --config=configs/default.py --workdir=DIR`.

Without `TF_CONFIG` it starts a local loopback cluster (`--config.num_workers` workers,
`--config.num_ps` parameter servers), trains, evaluates, writes the workdir and stops every
process. With `TF_CONFIG` the task's role decides: `chief` trains, `worker`/`ps` serve
until SIGTERM, `evaluator` evaluates new checkpoints. See docs/launcher.md.

Config fields are overridden with `--config.<field>=<value>`, for example
`--config.epochs=5 --config.optimizer.learning_rate=0.1 --config.gem.enabled=False`.
`--help` lists every flag and config field (`tf_asgd.launch.config_fields.CONFIG_FIELDS`).
TensorFlow's start-up lines and INFO logs are off in the launcher and every task it starts,
unless `--verbose_tf`.
"""

import contextlib
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tf_asgd import data

# Standard library and numpy only until `main` has moved the run into its
# network namespace: a process that has loaded TensorFlow (seconds on a
# small machine) would load it again after the re-exec.
from tf_asgd.cluster import network, task_server, tf_config, tf_startup
from tf_asgd.launch import config_fields

config_flags.DEFINE_config_file(
    "config",
    None,
    "Path to a config file with get_config() (e.g. configs/default.py).\n"
    + config_fields.config_help(),
    lock_config=True,
)
flags.DEFINE_string(
    "workdir",
    None,
    "Output directory: checkpoints/, model.keras, tensorboard/, metrics.csv, results.json. "
    "Needed by the chief, the evaluator and local runs; worker and ps tasks ignore it.",
)
flags.DEFINE_bool(
    "resume",
    False,
    "Continue from the newest checkpoint in --workdir (central variables, optimizer step, "
    "version counter, outer optimizer state, epoch count).",
)
flags.DEFINE_integer(
    "gpus_per_worker",
    None,
    "GPUs per local worker process, each worker seeing its own through CUDA_VISIBLE_DEVICES; "
    "overrides config.gpus_per_worker. PS tasks and the chief never use a GPU.",
)
flags.DEFINE_enum(
    "isolate_network",
    "auto",
    ["auto", "yes", "no"],
    "Local runs: run the chief and its tasks in a network namespace whose only interface is "
    "loopback, so that no one outside can reach their ports (TF 2.21 listens on 0.0.0.0 and "
    "has no authentication). auto: when the kernel allows it and no data must be "
    "downloaded, else a warning; yes: or stop; no: listen on every interface. Ignored "
    "under TF_CONFIG.",
)
flags.DEFINE_string(
    "bandwidth",
    None,
    "Local runs: limit the network to this rate, e.g. 100mbit, 1gbit or a number of "
    "bits/s: a token bucket (tc tbf) on the loopback of the run's own network namespace, "
    "one link shared by the chief and every task. Implies --isolate_network=yes; refused "
    "with --isolate_network=no and under TF_CONFIG.",
)
flags.DEFINE_bool(
    "verbose_tf",
    False,
    "Show TensorFlow's own logs: its start-up lines and C++ INFO logs "
    "(TF_CPP_MIN_LOG_LEVEL=0) in the launcher and in every task it starts, and its "
    "Python INFO logs. Off by default: errors and warnings are shown either way.",
)
flags.DEFINE_float(
    "stop_timeout",
    60.0,
    "After Ctrl-C or SIGTERM the launcher saves a checkpoint and stops its local "
    "cluster, then exits; if that takes longer than this many seconds (TF blocked), it "
    "prints every thread's stack and exits with status 1 (0 = no bound).",
)
FLAGS = flags.FLAGS


def isolate_local_run(mode, config):
    """Moves a local run into a loopback-only network namespace (see
    `tf_asgd.cluster.network`), or says why not. Returns only inside the namespace,
    or when the run stays outside it."""
    if mode == "no":
        return
    if (
        mode == "auto"
        and not network.in_loopback_namespace()
        and config.download
        and data.needs_download(config.dataset, config.data_dir)
    ):
        logging.warning(
            "Not isolating the local cluster to loopback: %s must be downloaded first "
            "(a loopback-only namespace has no network). Its ports listen on every "
            "interface; once the data is here, runs are isolated.",
            config.dataset,
        )
        return
    try:
        # Outside: does not return. Inside, TF starts quietly (see quiet_tf_startup).
        network.reexec_in_loopback_namespace(
            tf_startup.python_command("tf_asgd.launch", sys.argv[1:])
        )
    except OSError as e:
        if mode == "yes":
            sys.exit(f"tf_asgd.launch: --isolate_network=yes, but {e}.")
        logging.warning(
            "The local cluster's ports listen on every interface (TF 2.21 binds 0.0.0.0; "
            "its gRPC has no authentication) because %s. Firewall this machine, or "
            "pass --isolate_network=no to accept this.",
            e,
        )
        return
    logging.info(
        "Isolated: this run has its own network namespace with only loopback; "
        "no one outside can reach the cluster's ports."
    )


def check_bandwidth_flag(value, role, isolate, config):
    """`--bandwidth` in bits/s (`None` without it), or a usage error naming the conflict."""
    if value is None:
        return None
    try:
        rate = network.parse_bandwidth(value)
    except ValueError as e:
        raise app.UsageError(f"--bandwidth: {e}") from None
    if role is not None:
        raise app.UsageError(
            "--bandwidth limits a local run's own network namespace; under TF_CONFIG the "
            "tasks run on their machines' network (limit it there)."
        )
    if isolate == "no":
        raise app.UsageError(
            "--bandwidth needs the run in its own network namespace: it cannot be combined "
            "with --isolate_network=no."
        )
    if not network.in_loopback_namespace():
        try:
            network.check_available()
        except OSError as e:
            sys.exit(f"tf_asgd.launch: --bandwidth needs a network namespace of its own, but {e}.")
        if config.download and data.needs_download(config.dataset, config.data_dir):
            sys.exit(
                f"tf_asgd.launch: --bandwidth runs in a network namespace without a network, "
                f"but {config.dataset} must be downloaded first: run once without --bandwidth."
            )
    return rate


def limit_local_bandwidth(rate):
    """Limits this run's namespace loopback to `rate` bits/s, or exits saying why not."""
    try:
        network.limit_bandwidth(rate)
        limit, burst = network.bandwidth_limit()
    except (OSError, RuntimeError) as e:
        sys.exit(f"tf_asgd.launch: --bandwidth={rate}bit, but {e}.")
    logging.info(
        "Bandwidth: this run's loopback is limited to %d bits/s (tbf, burst %d bytes), "
        "one link for the chief and every task.",
        limit,
        burst,
    )


def refuse_a_used_workdir(workdir):
    """Exits, saying why, if `workdir` holds a checkpoint: without `--resume` the run would
    write over it. Read from TF's `checkpoint` state file before TensorFlow is loaded, so
    the refusal is immediate (the chief checks again with TF)."""
    ckpt_dir = os.path.join(workdir, config_fields.CHECKPOINT_DIR)
    try:
        with open(os.path.join(ckpt_dir, "checkpoint")) as f:
            m = re.search(r'^model_checkpoint_path: "(.*)"$', f.read(), re.MULTILINE)
    except OSError:
        return
    latest = m and os.path.join(ckpt_dir, m.group(1))
    if latest and os.path.exists(latest + ".index"):
        sys.exit(f"tf_asgd.launch: {config_fields.used_workdir_message(workdir, latest)}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/default.py")
    if FLAGS.gpus_per_worker is not None:
        config.gpus_per_worker = FLAGS.gpus_per_worker
    try:
        role = tf_config.tf_config_role()  # fails at once on a malformed TF_CONFIG
    except ValueError as e:
        sys.exit(f"tf_asgd.launch: bad TF_CONFIG: {e}")
    if FLAGS.workdir is None and (role is None or role[1] in ("chief", "evaluator")):
        raise app.UsageError("--workdir is required for local runs, the chief and the evaluator.")
    if not FLAGS.resume and (role is None or role[1] == "chief"):
        refuse_a_used_workdir(FLAGS.workdir)
    rate = check_bandwidth_flag(FLAGS.bandwidth, role, FLAGS.isolate_network, config)
    if role is None:
        isolate_local_run("yes" if rate else FLAGS.isolate_network, config)
        if rate:
            limit_local_bandwidth(rate)
    # A local cluster's tasks are forked from a copy of this process, made once TF is
    # imported and before its runtime starts: one TensorFlow import for the whole run.
    forks = role is None and not config.gpus_per_worker
    with import_tf_quietly(FLAGS.verbose_tf, fork_server=forks):
        _train(config)


def _train(config):
    """Runs the role of this process (`roles.run`), or exits saying why it stopped."""
    from tf_asgd import internals
    from tf_asgd.cluster import lost_tasks
    from tf_asgd.launch import library as train_lib
    from tf_asgd.launch import roles as training

    train_lib.configure_tf_python_logging(FLAGS.verbose_tf)
    logging.info("config:\n%s", "\n".join(config_lines(config)))
    stop = train_lib.StopSignals(FLAGS.stop_timeout)
    try:
        training.run(
            config, FLAGS.workdir and os.path.abspath(FLAGS.workdir), resume=FLAGS.resume, stop=stop
        )
    except lost_tasks.ClusterTaskLostError as e:
        logging.error("%s", e)
        sys.exit(f"tf_asgd.launch: {e}")
    except KeyboardInterrupt:
        logging.warning(
            "stopped by %s. Rerun with --resume to continue from the newest checkpoint.",
            f"signal {stop.signum}" if stop.signum else "KeyboardInterrupt",
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
