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

import re
import sys

from absl import app, flags
from ml_collections import config_flags

# Standard library and numpy only (`process`): the run re-executes itself in its network
# namespace before it loads TensorFlow.
from tf_asgd.launch import config_fields, process

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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _config()
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/default.py")
    process.launch(
        config,
        FLAGS.workdir,
        resume=FLAGS.resume,
        gpus_per_worker=FLAGS.gpus_per_worker,
        isolate_network=FLAGS.isolate_network,
        bandwidth=FLAGS.bandwidth,
        verbose_tf=FLAGS.verbose_tf,
        stop_timeout=FLAGS.stop_timeout,
    )


def _config():
    """`--config` as loaded, or an exit with one line (`config_error`)."""
    try:
        config = FLAGS.config
        if config is not None:
            config.keys()  # one that failed to load raises when first read
        return config
    except (OSError, KeyError, AttributeError, TypeError, ValueError) as e:
        sys.exit(config_error(e))


def parse_flags(argv):
    """absl's flag parsing, where a config file that cannot be read or a `--config.FIELD`
    that names no field exits with one line (ml_collections raises them as tracebacks,
    which absl's own parser lets through)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"tf_asgd.launch: {e}\nPass --help to see the flags.")
    except (OSError, KeyError, AttributeError, TypeError, ValueError) as e:
        sys.exit(config_error(e))


def config_error(error):
    """The launcher's one line for a config that did not load."""
    cause = error.__cause__ if error.__cause__ is not None else error
    if isinstance(error, OSError):
        path = FLAGS["config"].config_filename or "?"
        return (
            f"tf_asgd.launch: --config: could not load {path!r} (a path relative to the "
            f"directory you run from): {_first_line(cause)}"
        )
    text = str(cause.args[0]) if cause.args else str(cause)
    if "Did you mean" in text:  # ml_collections' unknown field: a repr inside a repr
        field = re.search(r"[A-Za-z_][\w.]*", text).group(0)
        hint = text[text.index("Did you mean") :].rstrip("'")
        text = f"no field {field!r}. {hint}"
    return f"tf_asgd.launch: --config: {' '.join(text.split())}"


def _first_line(error):
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
